"""The CPU value store: round trips, page reuse, the capacity bound, and the core protocol."""

import ctypes
import random

import pytest
import torch
from torch_threads import torch_threads

from vllm_shadowkv.core import native, ops
from vllm_shadowkv.core.compress import compress_prompt
from vllm_shadowkv.core.decode import DecodeBatch, decode_step
from vllm_shadowkv.core.params import ShadowKVParams
from vllm_shadowkv.core.rope import RopeCache, apply_rope
from vllm_shadowkv.core.store import InMemoryValueStore
from vllm_shadowkv.store import CpuValueStore, ValueStoreFull

C, D = 8, 16


@pytest.fixture(autouse=True, params=["c", "torch"])
def gather_path(request):
    """Every test with the C gather (where the kernels build) and with the torch one."""
    if request.param == "c" and native.library() is None:
        pytest.skip("the C gather needs a compiler")
    with ops.kernel_mode("auto" if request.param == "c" else "torch"):
        yield request.param


def make_store(capacity_bytes=1 << 24, dtype=torch.float32, page_rows=16):
    return CpuValueStore(capacity_bytes, dtype, row_shape=(C, D), page_rows=page_rows,
                         pin_memory=False)


def values(heads, chunks, dtype=torch.float32):
    return torch.randn(heads, chunks, C, D).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_random_shapes(dtype):
    gen = torch.Generator().manual_seed(0)
    # Small pages, so keys span many pages and some span several extents.
    store = make_store(dtype=dtype, page_rows=4)
    sources = {}
    for i, (heads, chunks) in enumerate([(1, 1), (3, 7), (2, 33), (8, 13), (5, 101)]):
        sources[("req", i)] = values(heads, chunks, dtype)
        store.put(("req", i), sources[("req", i)])
    assert len(store._extents) > 1
    assert any(len(entry.extents) > 1 for entry in store._entries.values())
    for key, src in sources.items():
        heads, chunks = src.shape[:2]
        m = 3 * heads * chunks
        h = torch.randint(heads, (m,), generator=gen)
        ch = torch.randint(chunks, (m,), generator=gen)
        got = store.gather(key, h, ch.int())
        assert got.device.type == "cpu" and got.dtype == dtype and got.shape == (m, C, D)
        assert torch.equal(got, src[h, ch])
        every = store.gather(key, torch.arange(heads).repeat_interleave(chunks),
                             torch.arange(chunks).repeat(heads))
        assert torch.equal(every, src.reshape(-1, C, D))


def test_page_offsets_address_every_row_where_it_lies():
    """What the in-place Triton kernel reads: row r of a key at pool + offsets[r // page_rows]
    + (r % page_rows) row sizes, pages of every extent in the same address space."""
    store = make_store(page_rows=4)
    sources = {i: values(h, n) for i, (h, n) in enumerate([(2, 9), (1, 1), (4, 37)])}
    for key, src in sources.items():
        store.put(key, src)
    assert len(store._extents) > 1
    pool, row_numel = store.pool, C * D
    for key, src in sources.items():
        offsets = store.page_offsets(key)
        assert offsets.dtype == torch.int64
        for r, want in enumerate(src.reshape(-1, C, D)):
            element = int(offsets[r // 4]) + (r % 4) * row_numel
            memory = (ctypes.c_char * (row_numel * 4)).from_address(
                pool.data_ptr() + element * pool.element_size())
            assert torch.equal(torch.frombuffer(memory, dtype=torch.float32).view(C, D), want)
    store.free(1)
    with pytest.raises(KeyError, match="never put, or freed"):
        store.page_offsets(1)


def test_one_gather_for_many_keys_equals_a_gather_per_key():
    gen = torch.Generator().manual_seed(1)
    store = make_store(page_rows=4)  # keys over several pages and extents
    sources = {("req", i): values(h, n) for i, (h, n) in enumerate([(2, 9), (1, 1), (4, 37)])}
    for key, src in sources.items():
        store.put(key, src)
    keys = [("req", 2), ("req", 0), ("req", 1), ("req", 2)]  # any order, repeats, empty parts
    counts = [11, 0, 3, 5]
    heads, chunks, expected = [], [], []
    for key, m in zip(keys, counts):
        h_kv, n = sources[key].shape[:2]
        h, ch = torch.randint(h_kv, (m,), generator=gen), torch.randint(n, (m,), generator=gen)
        heads.append(h), chunks.append(ch), expected.append(sources[key][h, ch])
    out = torch.empty(sum(counts), C, D)
    got = store.gather_many(keys, torch.cat(heads), torch.cat(chunks), counts, out)
    assert got is out and torch.equal(out, torch.cat(expected))
    reference = InMemoryValueStore()
    for key, src in sources.items():
        reference.put(key, src)
    assert torch.equal(reference.gather_many(keys, torch.cat(heads), torch.cat(chunks), counts,
                                             torch.empty_like(out)), out)
    with pytest.raises(IndexError, match=r"\('req', 1\) holds 1 heads x 1 rows"):
        store.gather_many(keys[:3], torch.tensor([0, 0]), torch.tensor([8, 1]), [1, 0, 1],
                          torch.empty(2, C, D))


def test_gather_on_two_threads_equals_one():
    """The C gather splits its rows over torch's threads (from 64 rows on)."""
    store, src = make_store(dtype=torch.bfloat16, page_rows=4), values(3, 50, torch.bfloat16)
    store.put("k", src)
    heads, chunks = torch.randint(3, (301,)), torch.randint(50, (301,))
    for threads in (1, 2):
        with torch_threads(threads):
            out = store.gather_many(["k"], heads, chunks, [301],
                                    torch.empty(301, C, D, dtype=torch.bfloat16))
        assert torch.equal(out, src[heads, chunks])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_many_into_given_rows(dtype):
    """``out_rows``: row i lands at out[out_rows[i]] (the CPU decode step's slots), the other
    rows of ``out`` untouched, the same with either store; keys over several extents; and with
    ``out_rows`` [n, c], each of a stored row's c token rows to a row of its own."""
    gen = torch.Generator().manual_seed(2)
    store, reference = make_store(dtype=dtype, page_rows=4), InMemoryValueStore()
    sources = {key: values(h, n, dtype) for key, (h, n) in {"a": (3, 21), "b": (2, 6)}.items()}
    for key, src in sources.items():
        store.put(key, src), reference.put(key, src)
    keys, counts = ["b", "a"], [5, 17]
    heads = torch.cat([torch.randint(sources[k].shape[0], (n,), generator=gen)
                       for k, n in zip(keys, counts)])
    chunks = torch.cat([torch.randint(sources[k].shape[1], (n,), generator=gen)
                        for k, n in zip(keys, counts)])
    out_rows = torch.randperm(40, generator=gen)[:22]
    before = torch.randn(40, C, D).to(dtype)
    got = store.gather_many(keys, heads, chunks, counts, before.clone(), out_rows)
    expected = before.clone()
    expected[out_rows] = torch.cat([sources[k][h, c] for k, h, c in
                                    zip(keys, heads.split(counts), chunks.split(counts))])
    assert torch.equal(got, expected)
    assert torch.equal(reference.gather_many(keys, heads, chunks, counts, before.clone(),
                                             out_rows), expected)
    assert store.bytes_fetched == 22 * C * D * before.element_size()
    # Token rows: each stored row's C rows to rows of their own (out [M, D]).
    token_rows = torch.randperm(40 * C, generator=gen)[:22 * C].view(22, C)
    flat = before.view(-1, D)
    expected = flat.clone()
    expected[token_rows] = torch.cat([sources[k][h, c] for k, h, c in
                                      zip(keys, heads.split(counts), chunks.split(counts))])
    for s in (store, reference):
        assert torch.equal(s.gather_many(keys, heads, chunks, counts, flat.clone(), token_rows),
                           expected)


def test_a_bad_row_or_destination_changes_nothing(gather_path):
    """A wanted row its key does not hold, or a destination outside ``out``: an error naming
    it, and no row of ``out`` written (rows are checked before any is copied)."""
    store = make_store(page_rows=4)
    store.put("a", values(2, 9)), store.put("b", values(3, 5))
    out = torch.zeros(6, C, D)
    with pytest.raises(IndexError, match=r"'b' holds 3 heads x 5 rows; asked for head 1, row 5"):
        store.gather_many(["a", "b"], torch.tensor([1, 0, 1]), torch.tensor([8, 4, 5]), [1, 2],
                          out)
    assert (out == 0).all()
    if gather_path == "c":  # (torch's own indexing refuses it in the other path)
        with pytest.raises(IndexError, match="destination row"):
            store.gather_many(["a"], torch.tensor([1, 0]), torch.tensor([8, 4]), [2], out,
                              torch.tensor([2, 6]))
        assert (out == 0).all()


def test_put_accepts_a_permuted_view_and_empty_gathers():
    store = make_store()
    src = torch.randn(5, 3, C, D)  # [n_chunks, h, c, d] as compress_prompt permutes it
    store.put("k", src.permute(1, 0, 2, 3))
    assert torch.equal(store.gather("k", torch.tensor([2, 0]), torch.tensor([4, 1])),
                       src[[4, 1], [2, 0]])
    empty = torch.zeros(0, dtype=torch.long)
    assert store.gather("k", empty, empty).shape == (0, C, D)


def test_pages_are_reused_after_free():
    rng = random.Random(1)
    store = make_store(capacity_bytes=1 << 22)
    live, peak_allocated = [], []
    for cycle in range(1000):
        key = ("r", cycle)
        store.put(key, values(rng.randint(1, 4), rng.randint(1, 40)))
        live.append(key)
        if len(live) > 6:
            store.free(live.pop(rng.randrange(len(live))))
        peak_allocated.append(store.allocated_bytes)
    assert peak_allocated[100] == peak_allocated[-1]  # grows while warming up, then stops
    assert store.allocated_bytes <= store.capacity_bytes
    for key in live:
        store.free(key)
    assert store.used_bytes == 0 and store.num_keys == 0
    store.free(("r", 0))  # already freed: a no-op
    store.free("never-put")
    assert store.used_bytes == 0


def test_capacity_is_enforced_and_a_failed_put_changes_nothing():
    store = make_store(capacity_bytes=10 * 16 * C * D * 4)  # ten pages of 16 rows
    assert store.capacity_bytes == 10 * store.page_bytes
    assert store.bytes_needed(2, 40) == 5 * store.page_bytes
    store.put(("req-a", 0), values(2, 40))
    store.put(("req-b", 0), values(2, 40))
    assert store.used_bytes == store.capacity_bytes == store.allocated_bytes
    assert store.can_fit(0) and not store.can_fit(1)
    before = (store.used_bytes, store.allocated_bytes, store.num_keys, store.bytes_put,
              list(store._free))
    with pytest.raises(ValueStoreFull) as err:
        store.put(("req-c", 3), values(1, 1))
    message = str(err.value)
    assert isinstance(err.value, RuntimeError)
    for part in ("('req-c', 3)", f"needs {store.page_bytes} bytes", "0 bytes free",
                 str(store.capacity_bytes), "value_store_gib or --kv-offloading-size"):
        assert part in message
    assert (store.used_bytes, store.allocated_bytes, store.num_keys, store.bytes_put,
            list(store._free)) == before
    with pytest.raises(KeyError, match="req-c"):
        store.gather(("req-c", 3), torch.tensor([0]), torch.tensor([0]))
    store.free(("req-a", 0))
    store.put(("req-c", 3), values(1, 1))  # fits once space is given back
    assert store.allocated_bytes == store.capacity_bytes


def test_misuse_is_refused():
    store = make_store()
    store.put("k", values(2, 3))
    with pytest.raises(ValueError, match="already stored"):
        store.put("k", values(2, 3))
    with pytest.raises(ValueError, match="expected"):
        store.put("other", values(2, 3, torch.bfloat16))
    with pytest.raises(IndexError, match="2 heads x 3 rows"):
        store.gather("k", torch.tensor([0]), torch.tensor([3]))
    store.clear()
    assert store.num_keys == 0 and store.used_bytes == 0 and store.allocated_bytes > 0
    with pytest.raises(KeyError, match="'k'"):
        store.gather("k", torch.tensor([0]), torch.tensor([0]))


def test_allocation_is_lazy():
    store = CpuValueStore(1 << 40, torch.bfloat16, row_shape=(8, 128), pin_memory=False)
    assert store.allocated_bytes == 0 and store.capacity_bytes == 1 << 40
    src = torch.randn(8, 300, 8, 128).bfloat16()
    store.put("k", src)
    assert store.used_bytes == store.bytes_needed(8, 300) <= store.allocated_bytes
    assert store.allocated_bytes <= 2 * store.used_bytes  # the pool grows by doubling at most
    assert torch.equal(store.gather("k", torch.tensor([7]), torch.tensor([299]))[0], src[7, 299])
    assert store.allocated_bytes < 1e-4 * store.capacity_bytes


def test_gather_many_into_a_view_and_counters():
    store = make_store(dtype=torch.bfloat16)
    src = values(3, 9, torch.bfloat16)
    store.put("k", src)
    assert store.bytes_put == src.numel() * 2 and store.bytes_fetched == 0
    h, ch = torch.tensor([2, 0, 1, 2]), torch.tensor([8, 0, 4, 8])
    out = torch.zeros(6, C, D, dtype=torch.bfloat16)
    view = out[1:5]
    assert store.gather_many(["k", "unstored"], h, ch, [4, 0], view) is view
    assert torch.equal(out[1:5], src[h, ch]) and (out[0] == 0).all() and (out[5] == 0).all()
    row_bytes = C * D * 2
    assert store.bytes_fetched == 4 * row_bytes
    store.gather("k", h[:2], ch[:2])
    assert store.bytes_fetched == 6 * row_bytes
    store.free("k")
    assert store.bytes_put == src.numel() * 2  # cumulative: freeing does not rewind counters


def _rope(head_dim, max_position):
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return RopeCache(torch.cat((freqs.cos(), freqs.sin()), dim=-1), head_dim, True)


def test_decode_step_is_identical_with_the_in_memory_store():
    """The store satisfies the core protocol: a sparse decode run (budget below the context, so
    selection, hits and misses all happen) gives bit-identical outputs with either store."""
    torch.manual_seed(3)
    h_kv, group, d, lengths = 2, 4, D, [300, 170, 40]  # the last stays exact
    rope = _rope(d, 512)
    pos = torch.cat([torch.arange(n) for n in lengths])
    keys = apply_rope(torch.randn(sum(lengths), h_kv, d), pos, rope)
    vals = torch.randn(sum(lengths), h_kv, d)
    params = ShadowKVParams(rank=16, chunk_size=C, sparse_budget=4 * C, outlier_chunks=2,
                            local_chunks=2, min_compress_tokens=100)
    ids = [("a", 0), ("b", 0), ("c", 0)]
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    stores = [InMemoryValueStore(), make_store(page_rows=8)]
    def compressed(store):
        return [compress_prompt(keys[a:b], vals[a:b], pos[a:b], rope, params, store, key)
                for a, b, key in zip(cu[:-1], cu[1:], ids)]

    batches = [DecodeBatch.build(compressed(s), ids, rope, params) for s in stores]
    assert stores[1].num_keys == 2  # the exact request puts nothing
    for step in range(4):
        q = torch.randn(3, 1, h_kv * group, d)
        new_pos = torch.tensor(lengths).view(3, 1) + step
        k_new = torch.stack([apply_rope(torch.randn(1, h_kv, d), p, rope) for p in new_pos])
        v_new = torch.randn(3, 1, h_kv, d)
        outs = [decode_step(b, q, k_new, v_new, s) for b, s in zip(batches, stores)]
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert stores[1].bytes_fetched > 0
    for key in ids:
        stores[1].free(key)
    assert stores[1].used_bytes == 0


@pytest.mark.parametrize("row_shape", [(8, 96), (8, 128), (3, 5)])
def test_extents_pin_less_than_a_page_beyond_their_pages(row_shape):
    """Torch's pinned allocator rounds each block up to a power of two bytes: an extent holds
    the pages that fit in one, so a page of 3 x 2^k bytes (head size 96) does not pin a third
    more than the store counts. Power-of-two pages keep power-of-two extents."""
    store = CpuValueStore(5 << 20, torch.bfloat16, row_shape, page_rows=16, pin_memory=False)
    rows = store.capacity_bytes // store.row_bytes // 16 * 16
    for i in range(0, rows, 16 * 7):
        n = min(16 * 7, rows - i)
        store.put(i, torch.zeros(1, n, *row_shape, dtype=torch.bfloat16))
    assert store.used_bytes == store.allocated_bytes == store.capacity_bytes
    for extent in store._extents:
        nbytes = extent.numel() * extent.element_size()
        pinned = 1 << (nbytes - 1).bit_length()
        assert pinned - nbytes < store.page_bytes
        if store.page_bytes & (store.page_bytes - 1) == 0:
            assert nbytes == pinned
