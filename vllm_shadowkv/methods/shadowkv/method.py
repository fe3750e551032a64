"""ShadowKV (Sun et al., 2024) on the shared engine: low-rank pre-RoPE keys, chunk landmarks
and outliers in the pages, values in the host store, top-k chunks rebuilt at each decode step."""

from __future__ import annotations

import torch

from vllm_shadowkv.backend.exact_attention import causal_attention, read_exact
from vllm_shadowkv.core.compress import compress_prompt
from vllm_shadowkv.core.decode import DecodeBatch, decode_step
from vllm_shadowkv.core.fidelity import attended_chunks, chunk_attention_mass, measure_fidelity
from vllm_shadowkv.methods.base import KVMethod, KVShapes, LayerContext, RequestRows
from vllm_shadowkv.methods.shadowkv.pages import ShadowKVPages, SparseState
from vllm_shadowkv.methods.shadowkv.settings import ShadowKVSettings
from vllm_shadowkv.store import paged_bytes


class ShadowKVMethod(KVMethod):
    name = "shadowkv"
    settings_cls = ShadowKVSettings
    needs_rope = True  # keys are factorised before RoPE and rebuilt with it
    # The paper's settings (§5.1): 576 B per compressed token and layer instead of 4 KiB.
    capacity_claim = ({"rank": 160, "chunk_size": 8, "sparse_budget": 2048,
                       "outlier_chunks": 48, "local_window": 32}, 6.0)

    def __init__(self, settings: ShadowKVSettings, shapes: KVShapes) -> None:
        super().__init__(settings, shapes)
        self.pages = ShadowKVPages(settings, shapes)
        self.params = settings.params

    @classmethod
    def covering_settings(cls, key_width: int, context_len: int) -> dict:
        chunk = ShadowKVSettings.chunk_size
        return {"rank": key_width, "sparse_budget": -(-context_len // chunk) * chunk,
                "outlier_chunks": 8}

    # -- pages --------------------------------------------------------------------------------
    def token_bytes(self, layer: int) -> int:
        return self.pages.token_bytes

    def is_sparse(self, prompt_len: int) -> bool:
        return self.pages.compressed_tokens(prompt_len) > 0

    def region_blocks(self, prompt_len: int) -> int:
        return self.pages.packed_blocks(prompt_len) + self.pages.state_blocks(prompt_len)

    def store_bytes(self, layer: int, prompt_len: int) -> int:
        rows = self.params.compressed_chunks(prompt_len) * self.shapes.num_kv_heads
        return paged_bytes(rows, self.settings.chunk_size * self.shapes.head_size
                           * self.shapes.elem_bytes)

    def store_row_shape(self, layer: int) -> tuple[int, ...]:
        return (self.settings.chunk_size, self.shapes.head_size)

    # -- hooks --------------------------------------------------------------------------------
    def finalize(self, layer: LayerContext, req: RequestRows, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
        positions = torch.arange(req.prompt_len, device=keys.device)
        prompt = compress_prompt(keys, values, positions, layer.rope, self.params, layer.store,
                                 (req.req_id, layer.index))
        region = layer.layout.region_ids(req.prompt_len, req.block_ids)
        self.pages.write_compressed(layer.kv_cache, region, prompt, keys)

    def decode(self, layer: LayerContext, reqs: list[RequestRows], query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, out: torch.Tensor) -> None:
        for req in reqs:
            rows = slice(req.start, req.end)
            out[rows] = self._decode_one(layer, req, query[rows], key[rows], value[rows])

    def _decode_one(self, layer: LayerContext, req: RequestRows, query, key, value):
        """query ``[s_q, Hq, d]``; key/value ``[s_q, Hkv, d]`` are this step's tokens (already
        in the generated-token pages)."""
        s_q, prompt_len = query.shape[0], req.prompt_len
        region = layer.layout.region_ids(prompt_len, req.block_ids)
        state = self.pages.read_state(layer.kv_cache, region, prompt_len)
        gen_positions = torch.arange(prompt_len, req.seq_len - s_q, device=query.device)
        gen_k, gen_v = read_exact(layer.kv_cache, layer.layout, prompt_len, req.block_ids,
                                  gen_positions)
        store_key = (req.req_id, layer.index)
        batch = DecodeBatch.build([state.prompt], [store_key], layer.rope, self.params,
                                  gen_capacity=len(gen_positions) + s_q)
        batch.slot_chunks, batch.slot_k, batch.slot_v = (
            state.slot_chunks[None], state.slot_k[None], state.slot_v[None])
        batch.gen_k[0, :, : len(gen_positions)] = gen_k.transpose(0, 1)
        batch.gen_v[0, :, : len(gen_positions)] = gen_v.transpose(0, 1)
        batch.gen_len[0] = len(gen_positions)
        before = state.slot_chunks
        out, _ = decode_step(batch, query[None], key[None], value[None], layer.store,
                             layer.scale)
        state.slot_chunks, state.slot_k, state.slot_v = (
            batch.slot_chunks[0], batch.slot_k[0], batch.slot_v[0])
        self.pages.write_slots(layer.kv_cache, region, prompt_len, state)

        selected = int((state.slot_chunks >= 0).sum())
        hits = int(((state.slot_chunks == before) & (before >= 0)).sum())
        stats = layer.stats(req.req_id)
        stats.decode_steps += 1
        stats.selected += selected
        stats.hits += hits
        stats.bytes_fetched += (selected - hits) * self.settings.chunk_size * \
            self.shapes.head_size * self.shapes.elem_bytes
        reference = layer.reference_kv.get(store_key)
        if reference is not None:
            self._record_fidelity(layer, state, reference, gen_k, gen_v, query, key, value,
                                  out[0], stats)
        return out[0]

    def _record_fidelity(self, layer: LayerContext, state: SparseState, reference, gen_k,
                         gen_v, query, key, value, out, stats, top: int = 8) -> None:
        """Dense attention over the exact prompt + generated tokens vs the sparse output, and
        the recall of each KV head's ``top`` chunks of largest dense attention mass."""
        ref_k, ref_v = (t.to(query.device) for t in reference)
        all_k, all_v = torch.cat([ref_k, gen_k, key]), torch.cat([ref_v, gen_v, value])
        dense = causal_attention(query, all_k, all_v, layer.scale)
        mass = chunk_attention_mass(query, ref_k, self.settings.chunk_size, layer.scale)
        attended = attended_chunks(state.prompt, state.slot_chunks, self.params)
        fid = measure_fidelity(out, dense, mass, attended, min(top, mass.shape[1]))
        stats.record_fidelity(layer.index, fid.relative_error, fid.chunk_recall)
