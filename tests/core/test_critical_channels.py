"""TailorKV's critical-channel token selection: the torch reference against a brute-force loop and
exact logits, the compiled CPU kernel (rows gathered), the Triton kernel (rows read in place
in a host store's pages, interpreted on the CPU, see conftest.py) and the C top-k (in place
too) against the reference, GQA groups 1/4/8, signed scores, the sink/recent/generated
exclusions, ties."""

import pytest
import torch

from vllm_shadowkv.core import cpu_kernels, native, ops
from vllm_shadowkv.core import critical_channels as cc
from vllm_shadowkv.store import CpuValueStore
from vllm_shadowkv.triton_kernels import channel_kernels

from test_kernels import needs_native

PROMPTS = [300, 0, 37, 129, 1000]  # irregular; empty; shorter than sink + recent
GRID = [(g, d, dt) for g in (1, 4, 8) for d in (64, 128) for dt in (torch.float32, torch.bfloat16)]


def _store_pages(keys_cm, key_start, prompt_len, chunk, page_rows, one_extent, device):
    """The keys put into a host store as TailorKV keeps them (channel-major rows of ``chunk``
    tokens; small pages, so the keys span several pages and, unless ``one_extent``, several
    extents) -> (the store, page offsets, first page per request). Keep the store while its
    pages are read: its extents after the first are freed with it."""
    h_kv, head_dim, _ = keys_cm.shape
    prompts = prompt_len.tolist()
    store = CpuValueStore(1 << 26, keys_cm.dtype, (chunk,), page_rows=page_rows,
                          pin_memory=device.type == "cuda")
    if one_extent:  # grow the pool once to hold every prompt, so that all lie in its first
        total = sum(-(-h_kv * head_dim * -(-n // chunk) // page_rows) * page_rows
                    for n in prompts)
        store.put("all", torch.zeros(1, total, chunk, dtype=keys_cm.dtype))
        store.free("all")
    offsets, starts = [], [0]
    for b, (start, n) in enumerate(zip(key_start.tolist(), prompts)):
        chunks = -(-n // chunk)
        rows = torch.nn.functional.pad(keys_cm[:, :, start:start + n].cpu(),
                                       (0, chunks * chunk - n))
        store.put(b, rows.reshape(h_kv, head_dim * chunks, chunk))
        offsets.append(store.page_offsets(b))
        starts.append(starts[-1] + len(offsets[-1]))
    assert len(store._extents) == 1 or not one_extent
    return (store, torch.cat(offsets).to(device),
            torch.tensor(starts[:-1], dtype=torch.int32, device=device))


def _paged(module, chunk=16, page_rows=4, one_extent=False):
    """A function shaped like `channel_scores` that puts the keys into a host store
    (`_store_pages`), then scores them in place with ``module.channel_scores_paged``."""
    def scores(q, keys_cm, channels, key_start, prompt_len, sink, recent, max_len):
        store, offsets, starts = _store_pages(keys_cm, key_start, prompt_len, chunk, page_rows,
                                              one_extent, q.device)
        scores.extents = len(store._extents)
        return module.channel_scores_paged(q, store.pool, offsets, starts, channels, prompt_len,
                                           sink, recent, max_len, chunk, page_rows)
    return scores


def _kernel(impl, device):
    if impl == "cpu":
        if device.type != "cpu" or not cpu_kernels.available():
            pytest.skip("compiled CPU kernels: CPU tensors and a C++ compiler")
        return cpu_kernels.channel_scores
    return _paged(channel_kernels)


KERNELS = ("triton", "cpu")


def _as_i32(xs, device):
    return torch.tensor(xs, dtype=torch.int32, device=device)


def _channel_major_pool(prompts, h_kv, head_dim, dtype, device, extra=5):
    """keys_cm [h_kv, d, N] (non-contiguous) holding each prompt followed by `extra` columns (a
    neighbour's or generated tokens) -> (keys_cm, key_start)."""
    starts, pos = [], 0
    for n in prompts:
        starts.append(pos)
        pos += n + extra
    keys = torch.randn(pos, head_dim, h_kv, device=device).to(dtype).permute(2, 1, 0)
    return keys, _as_i32(starts, device)


def _brute_force_scores(q, keys_cm, start, n, h, num_channels, sink, recent):
    """One (request, KV head) in plain loops: {token: partial score} over the middle tokens."""
    group = q.shape[0] // keys_cm.shape[0]
    head_dim = keys_cm.shape[1]
    qg = [sum(float(q[h * group + g, c]) for g in range(group)) for c in range(head_dim)]
    absmax = [max((abs(float(keys_cm[h, c, start + t])) for t in range(n)), default=0.0)
              for c in range(head_dim)]
    chosen = sorted(range(head_dim), key=lambda c: -abs(qg[c]) * absmax[c])[:num_channels]
    return {t: sum(qg[c] * float(keys_cm[h, c, start + t]) for c in chosen)
            for t in range(sink, n - recent)}


def _select(scores_fn, q, keys_cm, key_start, prompt_len, sink, recent, num_channels, k,
            q_channel=None):
    absmax = cc.key_channel_absmax(keys_cm, key_start, prompt_len)
    channels = cc.critical_channels(q if q_channel is None else q_channel, absmax, num_channels)
    max_len = int(prompt_len.max())
    scores = scores_fn(q, keys_cm, channels, key_start, prompt_len, sink, recent, max_len)
    return scores, cc.select_tokens(scores, prompt_len, sink, recent, k)


def _check_selection(ids, scores, prompt_len, sink, recent, k):
    """Ids are a set of the right size inside the window, holding the best scores (ties: as a
    set of scores, not of ids)."""
    for b, n in enumerate(prompt_len.tolist()):
        window = scores[b, :, sink:max(n - recent, sink)]
        take = min(k, window.shape[-1])
        assert (ids[b, :, take:] == -1).all()
        for h in range(ids.shape[1]):
            got = ids[b, h, :take].long()
            assert len(set(got.tolist())) == take
            assert ((got >= sink) & (got < n - recent)).all()
            best = torch.topk(window[h], take).values
            torch.testing.assert_close(scores[b, h, got].sort().values, best.sort().values)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_reference_matches_brute_force(group):
    h_kv, head_dim, sink, recent, num_channels, k = 2, 16, 3, 4, 5, 6
    prompts = [20, 0, 9, 31]
    keys_cm, key_start = _channel_major_pool(prompts, h_kv, head_dim, torch.float32, "cpu")
    prompt_len = _as_i32(prompts, "cpu")
    q = torch.randn(len(prompts), h_kv * group, head_dim)
    scores, ids = _select(cc.channel_scores, q, keys_cm, key_start, prompt_len, sink, recent,
                          num_channels, k)
    for b, (start, n) in enumerate(zip(key_start.tolist(), prompts)):
        for h in range(h_kv):
            want = _brute_force_scores(q[b], keys_cm, start, n, h, num_channels, sink, recent)
            row = scores[b, h]
            assert torch.isinf(row).sum() == row.numel() - len(want)
            for t, value in want.items():
                assert row[t].item() == pytest.approx(value, rel=1e-4, abs=1e-4)
            chosen = {t for t in ids[b, h].tolist() if t >= 0}
            assert chosen == set(sorted(want, key=want.get, reverse=True)[:k])


@pytest.mark.parametrize("group", [1, 4, 8])
def test_all_channels_give_the_exact_group_logits(group):
    h_kv, head_dim, sink, recent = 2, 32, 4, 8
    keys_cm, key_start = _channel_major_pool(PROMPTS, h_kv, head_dim, torch.float32, "cpu")
    prompt_len = _as_i32(PROMPTS, "cpu")
    q = torch.randn(len(PROMPTS), h_kv * group, head_dim)
    scores, _ = _select(cc.channel_scores, q, keys_cm, key_start, prompt_len, sink, recent,
                        head_dim, 1)
    for b, (start, n) in enumerate(zip(key_start.tolist(), PROMPTS)):
        if n - recent <= sink:
            assert torch.isinf(scores[b]).all()
            continue
        keys = keys_cm[:, :, start + sink:start + n - recent]  # [h, d, m]
        logits = torch.einsum("hgd,hdm->hgm", q[b].view(h_kv, group, head_dim), keys).sum(1)
        torch.testing.assert_close(scores[b, :, sink:n - recent], logits, atol=1e-4, rtol=1e-4)


def test_scores_are_signed():
    """A token whose partial score is the most negative (the largest magnitude) is never chosen."""
    h_kv, head_dim, n = 1, 8, 64
    keys_cm, key_start = _channel_major_pool([n], h_kv, head_dim, torch.float32, "cpu")
    q = torch.randn(1, h_kv, head_dim)
    keys_cm[0, :, 10] = -50.0 * q[0, 0].sign()
    keys_cm[0, :, 20] = 40.0 * q[0, 0].sign()
    prompt_len = _as_i32([n], "cpu")
    scores, ids = _select(cc.channel_scores, q, keys_cm, key_start, prompt_len, 0, 0, 4, 8)
    assert scores[0, 0, 10] < 0 and scores[0, 0, 10].abs() == scores[0, 0].abs().max()
    assert 20 in ids[0, 0].tolist() and 10 not in ids[0, 0].tolist()


def test_sink_recent_and_generated_tokens_never_compete():
    h_kv, head_dim, sink, recent, k = 2, 16, 4, 6, 200
    prompts = [50, 9]
    keys_cm, key_start = _channel_major_pool(prompts, h_kv, head_dim, torch.float32, "cpu",
                                             extra=7)
    q = torch.randn(2, h_kv * 4, head_dim)
    for b, (start, n) in enumerate(zip(key_start.tolist(), prompts)):
        # The tokens that must not compete get the best keys: sink, recent, and the columns
        # after the prompt (generated tokens held in the same store).
        best = 100.0 * q[b].view(h_kv, 4, head_dim).sum(1).sign()  # [h, d]
        for t in [*range(sink), *range(n - recent, n + 7)]:
            keys_cm[:, :, start + t] = best
    prompt_len = _as_i32(prompts, "cpu")
    scores, ids = _select(cc.channel_scores, q, keys_cm, key_start, prompt_len, sink, recent, 3,
                          k)
    _check_selection(ids, scores, prompt_len, sink, recent, k)
    assert (ids[0, :, :50 - sink - recent] >= 0).all()  # k covers the window: all of it
    assert (ids[1] == -1).all()  # nothing between sink and recent


def test_channels_use_the_channel_query():
    """The "predicted" mode: channels from one query, partial scores with another."""
    h_kv, head_dim = 1, 16
    keys_cm, key_start = _channel_major_pool([40], h_kv, head_dim, torch.float32, "cpu")
    absmax = cc.key_channel_absmax(keys_cm, key_start, _as_i32([40], "cpu"))
    q_channel = torch.zeros(1, 2, head_dim)
    q_channel[0, :, [3, 7]] = torch.tensor([[1.0, -2.0], [1.0, 0.5]])  # group sums 2, -1.5
    channels = cc.critical_channels(q_channel, absmax, 2)
    assert set(channels[0, 0].tolist()) == {3, 7}
    q_channel[0, 1, 7] = 2.0  # the group's signed sum cancels channel 7 out
    assert 7 not in cc.critical_channels(q_channel, absmax, 2)[0, 0].tolist()


def test_key_channel_absmax():
    keys_cm, key_start = _channel_major_pool(PROMPTS, 3, 16, torch.bfloat16, "cpu")
    got = cc.key_channel_absmax(keys_cm, key_start, _as_i32(PROMPTS, "cpu"))
    for b, (start, n) in enumerate(zip(key_start.tolist(), PROMPTS)):
        want = (keys_cm[:, :, start:start + n].float().abs().amax(-1) if n
                else torch.zeros(3, 16))
        assert torch.equal(got[b], want)


@pytest.mark.parametrize("chunk, page_rows", [(16, 4), (128, 256)])
@pytest.mark.parametrize("group", [1, 4])
def test_paged_reference_equals_the_gathered_one(group, chunk, page_rows):
    h_kv, head_dim, sink, recent = 2, 32, 5, 9
    keys_cm, key_start = _channel_major_pool(PROMPTS, h_kv, head_dim, torch.bfloat16, "cpu")
    q = torch.randn(len(PROMPTS), h_kv * group, head_dim).to(torch.bfloat16)
    args = (q, keys_cm, key_start, _as_i32(PROMPTS, "cpu"), sink, recent, 7, 33)
    got_scores, got_ids = _select(_paged(cc, chunk, page_rows, one_extent=True), *args)
    want_scores, want_ids = _select(cc.channel_scores, *args)
    assert torch.equal(got_scores, want_scores) and torch.equal(got_ids, want_ids)


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("group,head_dim,dtype", GRID)
def test_kernel_matches_reference(group, head_dim, dtype, impl, kernel_device):
    h_kv, sink, recent, num_channels, k = 2, 8, 120, 12, 96
    keys_cm, key_start = _channel_major_pool(PROMPTS, h_kv, head_dim, dtype, kernel_device)
    prompt_len = _as_i32(PROMPTS, kernel_device)
    q = torch.randn(len(PROMPTS), h_kv * group, head_dim, device=kernel_device).to(dtype)
    q_channel = torch.randn_like(q)
    args = (q, keys_cm, key_start, prompt_len, sink, recent, num_channels, k)
    kernel = _kernel(impl, kernel_device)
    got_scores, got_ids = _select(kernel, *args, q_channel=q_channel)
    want_scores, want_ids = _select(cc.channel_scores, *args, q_channel=q_channel)
    assert getattr(kernel, "extents", 2) > 1  # the paged kernel reads pages of several extents
    torch.testing.assert_close(got_scores, want_scores, atol=1e-5, rtol=1e-5)
    _check_selection(got_ids, want_scores, prompt_len, sink, recent, k)
    assert torch.equal(got_ids >= 0, want_ids >= 0)


def test_paged_kernel_reaches_pages_below_the_pool(kernel_device):
    """A store's later extents may lie below its first: negative page offsets."""
    h_kv, head_dim, chunk, page_rows, n = 2, 16, 16, 4, 100
    keys_cm, key_start = _channel_major_pool([n], h_kv, head_dim, torch.float32, "cpu")
    chunks = -(-n // chunk)
    rows = torch.nn.functional.pad(keys_cm[:, :, :n], (0, chunks * chunk - n)).reshape(-1, chunk)
    pages = rows.view(-1, page_rows * chunk)  # h_kv * d * chunks rows: whole pages here
    memory = pages.flip(0).flatten()  # the pages in reverse order
    if kernel_device.type == "cuda":
        memory = memory.pin_memory()  # host memory, read over the bus as the store's
    pool = memory[-page_rows * chunk:]  # the last page: every other one lies below it
    offsets = -torch.arange(len(pages), dtype=torch.int64) * page_rows * chunk
    q = torch.randn(1, h_kv * 4, head_dim, device=kernel_device)
    channels = cc.critical_channels(q, cc.key_channel_absmax(keys_cm, key_start,
                                                             _as_i32([n], "cpu")).to(q.device), 5)
    prompt_len = _as_i32([n], kernel_device)
    got = channel_kernels.channel_scores_paged(
        q, pool, offsets.to(kernel_device), _as_i32([0], kernel_device), channels, prompt_len,
        3, 7, n, chunk, page_rows)
    want = cc.channel_scores(q, keys_cm.to(kernel_device), channels,
                             key_start.to(kernel_device), prompt_len, 3, 7, n)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_kernel_with_ties(group, impl, kernel_device):
    """Few distinct key values: many equal scores; the selected scores must match as a set."""
    h_kv, head_dim, sink, recent, k = 2, 64, 8, 16, 50
    prompts = [400, 77, 1]
    keys_cm, key_start = _channel_major_pool(prompts, h_kv, head_dim, torch.float32,
                                             kernel_device)
    keys_cm.copy_(torch.randint(-1, 2, keys_cm.shape, device=kernel_device).float())
    q = torch.randint(-2, 3, (len(prompts), h_kv * group, head_dim), device=kernel_device).float()
    prompt_len = _as_i32(prompts, kernel_device)
    args = (q, keys_cm, key_start, prompt_len, sink, recent, 4, k)
    got_scores, got_ids = _select(_kernel(impl, kernel_device), *args)
    want_scores, _ = _select(cc.channel_scores, *args)
    assert torch.equal(got_scores, want_scores)
    _check_selection(got_ids, want_scores, prompt_len, sink, recent, k)


def _spy(monkeypatch, *targets) -> list[str]:
    """Each (name, module, function) records its name in the returned list when called."""
    calls = []
    for name, module, fn in targets:
        real = getattr(module, fn)
        monkeypatch.setattr(module, fn,
                            lambda *a, name=name, real=real: calls.append(name) or real(*a))
    return calls


def test_dispatch_routes_channel_scores(monkeypatch, interpreted):
    calls = _spy(monkeypatch, ("cpu", cpu_kernels, "channel_scores"),
                 ("torch", cc, "channel_scores"),
                 ("triton-paged", channel_kernels, "channel_scores_paged"),
                 ("torch-paged", cc, "channel_scores_paged"))
    keys_cm, key_start = _channel_major_pool([30], 1, 16, torch.float32, "cpu")
    channels = torch.zeros(1, 1, 4, dtype=torch.int32)
    args = (torch.randn(1, 2, 16), keys_cm, channels, key_start, _as_i32([30], "cpu"), 2, 2, 30)
    ops.channel_scores(*args)  # CPU tensors: the compiled kernel (with a compiler)
    with ops.kernel_mode("torch"):
        ops.channel_scores(*args)
    paged = _paged(ops)
    with ops.force_triton():
        paged(*args)
    with ops.kernel_mode("torch"):
        paged(*args)
    assert calls == ["cpu" if cpu_kernels.available() else "torch", "torch", "triton-paged",
                     "torch-paged", "torch"]  # (the paged reference gathers, then scores)


def _c_and_reference(q, keys_cm, key_start, prompt_len, sink, recent, num_channels, k,
                     one_extent=False):
    """The C top-k over the keys in store pages, and the reference's scores and ids over the
    same keys (gathered: the paged reference reads only the pool's first extent, and equals
    the gathered one, test_paged_reference_equals_the_gathered_one) -> (got, want, scores)."""
    absmax = cc.key_channel_absmax(keys_cm, key_start, prompt_len)
    channels = cc.critical_channels(q, absmax, num_channels)
    chunk, page_rows, max_len = 16, 4, int(prompt_len.max())
    store, offsets, starts = _store_pages(keys_cm, key_start, prompt_len, chunk, page_rows,
                                          one_extent, q.device)
    assert len(store._extents) > 1 or one_extent
    assert native.supports_channel_top_k(q, store.pool)
    got = native.channel_top_k(q, store.pool, offsets, starts, channels, prompt_len, sink,
                               recent, chunk, page_rows, k)
    scores = cc.channel_scores(q, keys_cm, channels, key_start, prompt_len, sink, recent,
                               max_len)
    return got, cc.select_tokens(scores, prompt_len, sink, recent, k), scores


@needs_native
@pytest.mark.parametrize("group,head_dim,dtype", GRID + [(4, 128, torch.float16)])
def test_c_top_k_matches_reference(group, head_dim, dtype):
    """The same set as the reference's, on irregular prompts (one empty, one shorter than sink
    + recent) spread over pages of several extents."""
    h_kv, sink, recent, num_channels, k = 2, 8, 120, 12, 96
    keys_cm, key_start = _channel_major_pool(PROMPTS, h_kv, head_dim, dtype, "cpu")
    prompt_len = _as_i32(PROMPTS, "cpu")
    q = torch.randn(len(PROMPTS), h_kv * group, head_dim).to(dtype)
    got, want, scores = _c_and_reference(q, keys_cm, key_start, prompt_len, sink, recent,
                                         num_channels, k)
    _check_selection(got, scores, prompt_len, sink, recent, k)
    assert torch.equal(got >= 0, want >= 0)


@needs_native
@pytest.mark.parametrize("k", [1, 50, 2000])
def test_c_top_k_with_ties_and_a_covering_k(k):
    """Few distinct key values: many equal scores (the selected scores match as a set); a k
    above every prompt's middle takes all of it."""
    h_kv, head_dim, sink, recent = 2, 64, 8, 16
    prompts = [400, 77, 1]
    keys_cm, key_start = _channel_major_pool(prompts, h_kv, head_dim, torch.float32, "cpu")
    keys_cm.copy_(torch.randint(-1, 2, keys_cm.shape).float())
    q = torch.randint(-2, 3, (len(prompts), h_kv * 4, head_dim)).float()
    prompt_len = _as_i32(prompts, "cpu")
    got, want, scores = _c_and_reference(q, keys_cm, key_start, prompt_len, sink, recent, 4, k,
                                         one_extent=True)
    _check_selection(got, scores, prompt_len, sink, recent, k)
    assert torch.equal(got >= 0, want >= 0)
    if k == 2000:
        assert (got[0, :, :400 - sink - recent] >= 0).all() and (got[2] == -1).all()


def test_dispatch_routes_channel_top_k(monkeypatch, interpreted):
    """CPU tensors: the C kernel (with a compiler); the reference in "torch" mode; the Triton
    scores and one torch.topk in "triton" mode."""
    calls = _spy(monkeypatch, ("c", native, "channel_top_k"),
                 ("triton-paged", channel_kernels, "channel_scores_paged"),
                 ("torch-paged", cc, "channel_scores_paged"))
    keys_cm, key_start = _channel_major_pool([30], 1, 16, torch.bfloat16, "cpu")
    prompt_len = _as_i32([30], "cpu")
    store, offsets, starts = _store_pages(keys_cm, key_start, prompt_len, 16, 4, False,
                                          torch.device("cpu"))
    pool = store.pool
    q = torch.randn(1, 2, 16).to(torch.bfloat16)
    args = (q, pool, offsets, starts, torch.zeros(1, 1, 4, dtype=torch.int32), prompt_len, 2, 2,
            30, 16, 4, 5)
    results = [ops.channel_top_k(*args)]
    assert ops.reads_channels_in_place(q, pool) == (native.library() is not None)
    with ops.kernel_mode("torch"):
        results.append(ops.channel_top_k(*args))
        assert not ops.reads_channels_in_place(q, pool)
    with ops.force_triton():
        results.append(ops.channel_top_k(*args))
        assert ops.reads_channels_in_place(q, pool)
    assert calls == (["c"] if native.library() else ["torch-paged"]) + ["torch-paged",
                                                                        "triton-paged"]
    for got in results[1:]:
        assert torch.equal(got >= 0, results[0] >= 0)


@needs_native
def test_c_top_k_among_equal_scores_takes_the_earliest_tokens():
    h_kv, head_dim, sink, recent, k = 2, 16, 3, 5, 10
    keys_cm, key_start = _channel_major_pool([300], h_kv, head_dim, torch.bfloat16, "cpu")
    got, _, _ = _c_and_reference(torch.zeros(1, h_kv, head_dim).to(torch.bfloat16), keys_cm,
                                 key_start, _as_i32([300], "cpu"), sink, recent, 4, k,
                                 one_extent=True)
    assert (got.sort(dim=-1).values == torch.arange(sink, sink + k, dtype=torch.int32)).all()
