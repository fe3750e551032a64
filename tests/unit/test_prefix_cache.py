"""Prefix caching of exact pages on vLLM's own scheduler-side classes (KVCacheManager, BlockPool,
Request): which pages are hashed, what a later request adopts, and where a hit must stop."""

from math import lcm

import pytest
import torch
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,
                                         maybe_convert_block_hash)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from vllm_shadowkv import plugin
from vllm_shadowkv.backend.kv_spec import CompressedKVSpec, page_hash
from vllm_shadowkv.config import Stamp, parse_settings
from vllm_shadowkv.methods import METHODS
from vllm_shadowkv.patches import kv_cache_events, prefix_cache_hits

BLOCK = 16
MIN_SPARSE = 256


# ShadowKV's defaults (2 exact tokens a page at these shapes) and its covering settings (9: a
# page that does not divide a block, so hits end inside blocks).
@pytest.fixture(scope="module", params=[{}, METHODS["shadowkv"].covering_settings(256, 2048)],
                ids=["pages-of-2", "pages-of-9"])
def spec(request):
    plugin.register()
    prefix_cache_hits.apply()
    kv_cache_events.apply()
    init_none_hash(sha256)
    settings = parse_settings(METHODS["shadowkv"].settings_cls,
                              request.param | {"min_sparse_len": MIN_SPARSE})
    base = CompressedKVSpec(block_size=BLOCK, num_kv_heads=4, head_size=64, dtype=torch.bfloat16,
                            num_head_slots=1, state_content_bytes=1, max_model_len=2048,
                            num_layers=2)
    stamp = Stamp("shadowkv", settings.resolved(base.shapes), store_bytes=1 << 30)
    return CompressedKVSpec.for_layer(base, stamp, 0, 2048, 2)


def manager(spec, num_blocks=4000, events=False):
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return KVCacheManager(config, max_model_len=2048, scheduler_block_size=BLOCK,
                          hash_block_size=BLOCK, enable_caching=True,
                          enable_kv_cache_events=events)


def request(name, tokens, **extra_args):
    return Request(name, tokens, SamplingParams(max_tokens=8, extra_args=extra_args or None),
                   None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def schedule(kv, req, blocks=None, hit=0):
    """The scheduler's admission of a new request: its prompt (less the hit) in one chunk."""
    assert kv.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None


def test_pages_are_keyed_by_the_block_that_covers_their_last_token():
    hashes = [b"a", b"b", b"c"]
    assert page_hash(hashes, 0, 5, 16) == page_hash(hashes, 0, 5, 16)
    assert page_hash(hashes, 2, 5, 16).startswith(b"a")  # tokens 10-14: block 0
    assert page_hash(hashes, 3, 5, 16).startswith(b"b")  # tokens 15-19: block 1
    assert page_hash(hashes, 9, 5, 16) is None  # tokens 45-49: block 3, not full yet
    assert page_hash(hashes, 3, 5, 16) != page_hash([b"a", b"x"], 3, 5, 16)


def test_a_later_request_adopts_the_prompt_pages_and_prefills_the_rest(spec):
    kv, per_page = manager(spec), spec.layout.exact_per_page
    prompt = list(range(1, 1000))  # compressed (beyond the sink, the local window, the outliers)
    assert spec.layout.is_sparse(len(prompt))
    first = request("first", prompt)
    schedule(kv, first)
    first.append_output_token_ids([7, 8])  # generated tokens are never shared
    kv.free(first)

    # Whole pages within vLLM's full blocks of the prompt (pages of 9: inside a block).
    expected = len(prompt) // BLOCK * BLOCK // per_page * per_page
    blocks, hit, _ = kv.get_computed_blocks(request("probe", prompt + [9]))
    assert hit == expected and len(blocks.blocks[0]) == hit // per_page
    again = request("again", prompt[:-1] + [99])  # same prefix, another last token
    blocks, hit, _ = kv.get_computed_blocks(again)
    assert hit == expected
    free_before = kv.block_pool.get_num_free_blocks()
    schedule(kv, again, blocks, hit)
    adopted = kv.get_blocks("again").blocks[0][:hit // per_page]
    assert [b.block_id for b in adopted] == [b.block_id for b in blocks.blocks[0]]
    layout = spec.layout
    # The adopted pages leave the free queue; the rest of the prompt's pages are new.
    assert free_before - kv.block_pool.get_num_free_blocks() == layout.peak_blocks(len(prompt))
    other = request("other", [5] + prompt[1:])  # differs in the first token: nothing shared
    assert kv.get_computed_blocks(other)[1] == 0


def test_a_recomputed_compressed_request_prefills_its_last_prompt_page_again(spec):
    """A preempted request's lookup covers its generated tokens: a prompt whose pages are all
    cached would be adopted whole, and no step would compress it (patches/prefix_cache_hits)."""
    kv, step = manager(spec), lcm(spec.layout.exact_per_page, BLOCK)
    whole = 1024 // step
    prompt = list(range(1, whole * step + 1))  # compressed, a whole number of pages and blocks
    assert spec.layout.is_sparse(len(prompt))
    first = request("first", prompt)
    schedule(kv, first)
    first.append_output_token_ids(list(range(100, 100 + 2 * BLOCK)))
    kv.free(first)
    first.num_computed_tokens = 0  # preempted: recomputed from its prompt and its output
    blocks, hit, _ = kv.get_computed_blocks(first)
    per_page = spec.layout.exact_per_page
    assert hit == (len(prompt) - 1) // per_page * per_page and len(blocks.blocks[0]) == hit // per_page
    # An exact (short) request's pages hold its whole sequence in place: no cut.
    short = request("short", prompt[:step])
    assert not spec.layout.is_sparse(step)
    schedule(kv, short)
    short.append_output_token_ids(list(range(2 * BLOCK)))
    kv.free(short)
    short.num_computed_tokens = 0
    assert kv.get_computed_blocks(short)[1] == step


def test_the_whole_sequence_check_sizes_a_recomputed_request_by_its_prompt(spec):
    """vLLM checks that a waiting request's whole sequence fits before ``remove_skipped_blocks``
    tells the manager the prompt length: the lookup does (patches/prefix_cache_hits), so a
    recomputed compressed request is sized as compressed, not as exact pages of its prompt and
    output (at these shapes a third of what it needs)."""
    kv = manager(spec)
    held = kv.coordinator.single_type_managers[0]
    first = request("first", list(range(1, 1025)))
    assert spec.layout.is_sparse(1024)
    schedule(kv, first)
    first.append_output_token_ids(list(range(100, 100 + 4 * BLOCK)))
    kv.free(first)
    first.num_computed_tokens = 0  # preempted
    assert first.request_id not in held.prompt_len
    kv.get_computed_blocks(first)
    assert held.prompt_len[first.request_id] == 1024
    sized = held.get_num_blocks_to_allocate(first.request_id, first.num_tokens, [], 0, 0,
                                            first.num_tokens, prefill_end=0)
    assert sized == spec.layout.blocks_needed(1024, first.num_tokens)  # not (0, ...): exact
    kv.free(first)
    assert first.request_id not in held.prompt_len


def test_an_exact_request_shares_its_generated_tokens_as_vllm_does(spec):
    """A short request's pages hold its whole sequence in place: the next turn of a chat (its
    prompt, its answer, a new question) adopts the answer's pages too, as vLLM's blocks are."""
    kv, per_page = manager(spec), spec.layout.exact_per_page
    first = request("first", list(range(1, 100)))
    assert not spec.layout.is_sparse(first.num_prompt_tokens)
    schedule(kv, first)
    for token in range(500, 500 + 3 * BLOCK):  # decode steps: each token's K/V written once
        first.num_computed_tokens = first.num_tokens
        first.append_output_token_ids(token)
        assert kv.allocate_slots(first, 1) is not None
    first.num_computed_tokens = first.num_tokens
    kv.free(first)
    turn = request("turn", list(first.all_token_ids) + [7, 8, 9])
    hit = kv.get_computed_blocks(turn)[1]
    assert hit == first.num_tokens // BLOCK * BLOCK // per_page * per_page
    assert hit > first.num_prompt_tokens


def stored_chain(events) -> list:
    """The block hashes a router learns from ``BlockStored`` events, checked to chain."""
    chain = []
    for event in events:
        if isinstance(event, BlockStored):
            assert event.parent_block_hash == (chain[-1] if chain else None)
            assert len(event.token_ids) == len(event.block_hashes) * BLOCK
            chain.extend(event.block_hashes)
    return chain


def test_kv_cache_events_speak_of_vllms_blocks(spec):
    """A KV-aware router indexes vLLM's chained block hashes: the pages' events must name the
    blocks a hit can reach, never the pages' own keys (patches/kv_cache_events)."""
    # A pool that holds one longest prompt while it is prefilled, so a second one evicts pages.
    num_blocks = spec.layout.peak_blocks(2048) + 2
    kv, per_page = manager(spec, num_blocks, events=True), spec.layout.exact_per_page
    prompt = list(range(1, 1000))
    first = request("first", prompt)
    names = [maybe_convert_block_hash(h) for h in first.block_hashes]
    schedule(kv, first)
    # Every block whose pages (and all before) are cached: a hit on it ends within a page of it.
    pages = len(prompt) // per_page
    announced = ((pages + 1) * per_page - 1) // BLOCK
    stored = stored_chain(kv.take_events())
    assert stored == names[:announced] and announced >= len(prompt) // BLOCK - 1
    hit = kv.get_computed_blocks(request("probe", prompt + [9]))[1]
    assert hit >= announced * BLOCK - per_page + 1
    kv.free(first)

    # A request asking for its hits to be reported ("full") gets them in blocks (it failed with
    # an IndexError: vLLM counted the hit's pages as blocks).
    again = request("again", prompt[:-1] + [7], kv_cache_report_mode="full")
    blocks, hit, _ = kv.get_computed_blocks(again)
    assert hit and stored_chain(kv.take_events()) == names[:announced]

    # Evicting the pages (new requests take every free block) removes blocks, by vLLM's hashes.
    other = request("other", [5] * 2040)
    schedule(kv, other)
    removed = [h for e in kv.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= set(names[:announced])
    assert kv.get_computed_blocks(request("probe2", prompt + [9]))[1] < announced * BLOCK
