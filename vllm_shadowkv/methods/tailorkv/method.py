"""TailorKV (Yao et al., 2025) on the shared engine: each layer is quantization-friendly (Q) or
sparsity-friendly (S), from ``q_layers`` (layers.py).

* **Q-layers** keep every prompt token KIVI-quantized on the pages (1 or 2 bits) and attend
  them with the fused dequantization, as MiniKV's pages with every token kept.
* **S-layers** keep only the sink and recent tokens on the pages; the whole prompt's 16-bit
  K/V go to the host store (rows of one token of one KV head) with a channel-major copy of the
  keys (rows of ``CHANNEL_CHUNK`` tokens of one channel). Each decode step picks, per KV head,
  the ``critical_channels`` channels with the largest |q| x max|K|, scores the prompt's middle
  tokens over those channel rows (signed partial dot products), takes the top-k, fetches the
  selected rows that missed the previous step's slots, and attends sink + recent + selected +
  generated tokens exactly. The kernels read the channel rows where the store keeps them: the
  Triton kernel on CUDA from pinned host memory, zero-copy, so a layer waits for the host once,
  for the missed rows; the C kernel on the CPU, which takes the top-k there too. Without
  either (the "torch" kernel mode, no C compiler) the rows are gathered first.

Generated tokens collect in the engine's 16-bit ring and are folded every ``residual`` tokens:
quantized in a Q-layer, as 16-bit rows in an S-layer (never offloaded, never scored)."""

from __future__ import annotations

import torch

from vllm_shadowkv.core import ops, transfer
from vllm_shadowkv.core.critical_channels import critical_channels, select_tokens
from vllm_shadowkv.methods.base import KVShapes, LayerContext, RequestRows
from vllm_shadowkv.methods.minikv.method import MiniKVMethod
from vllm_shadowkv.methods.slots import fetch_into_slots, held_slots
from vllm_shadowkv.methods.tailorkv.pages import TailorKVPages
from vllm_shadowkv.methods.tailorkv.settings import TailorKVSettings
from vllm_shadowkv.store import paged_bytes

CHANNEL_CHUNK = 128  # tokens of one key channel per row of the channel-major store copy


class TailorKVMethod(MiniKVMethod):
    name = "tailorkv"
    settings_cls = TailorKVSettings
    capacity_claim = ({"q_layers": [0]}, 9.0)
    capacity_lengths = (32768, 131072)
    needs_prefill_lse = False  # no heavy hitters: every token is kept or offloaded
    prefix_caching_off = None  # nothing is gathered while prefilling

    def __init__(self, settings: TailorKVSettings, shapes: KVShapes) -> None:
        super().__init__(settings, shapes)
        self.pages = TailorKVPages(settings, shapes)
        # Per (request, S-layer): max|K| per channel [h, d] fp32 (the channel choice), and the
        # prompt tokens in the slots [h, k] int32 (-1 empty; their rows follow the recent ones).
        self._absmax: dict[tuple[str, int], torch.Tensor] = {}
        self._slot_tokens: dict[tuple[str, int], torch.Tensor] = {}
        # Per (request, S-layer), on the Triton path: the store's page offsets of its key copy.
        self._channel_pages: dict[tuple[str, int], torch.Tensor] = {}

    @classmethod
    def covering_settings(cls, key_width: int, context_len: int) -> dict:
        # Every layer an S-layer (nothing quantized) whose top-k takes the whole middle.
        return {"q_layers": [], "top_k": context_len, "group_size": 32, "residual": 32}

    def layer_kind(self, layer: int) -> bool:
        """Q-layers and S-layers run different kernels."""
        return self.pages.quantized(layer)

    # -- pages and store ------------------------------------------------------------------------
    def store_bytes(self, layer: int, prompt_len: int) -> int:
        if self.pages.quantized(layer):
            return 0
        h, d, elem = self.shapes.num_kv_heads, self.shapes.head_size, self.shapes.elem_bytes
        chunks = -(-prompt_len // CHANNEL_CHUNK)  # of the channel-major key copy
        return (paged_bytes(h * prompt_len, self.store_row_bytes(layer))
                + paged_bytes(h * d * chunks, CHANNEL_CHUNK * elem))

    def store_row_shape(self, layer: int) -> tuple[int, ...]:
        return (2, self.shapes.head_size)  # one token of one KV head: key, value

    # -- hooks ----------------------------------------------------------------------------------
    def prefill_chunk(self, layer: LayerContext, req: RequestRows, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor,
                      lse: torch.Tensor | None = None) -> None:
        """Nothing to gather while prefilling: max|K| is taken from the whole prompt."""

    def finalize(self, layer: LayerContext, req: RequestRows, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
        if self.pages.quantized(layer.index):
            return super().finalize(layer, req, keys, values)
        prompt_len, key = req.prompt_len, (req.req_id, layer.index)
        local = self.pages.local_positions(prompt_len).to(keys.device)
        plan = self.pages.upto(
            self._plan(layer, req, self.pages.shape(layer.index, prompt_len)), 0)
        rows = slice(0, len(local))
        self.pages.write_rows(layer.kv_cache, plan.key_rows[:, rows].flatten(),
                              keys[local].transpose(0, 1))
        self.pages.write_rows(layer.kv_cache, plan.value_rows[:, rows].flatten(),
                              values[local].transpose(0, 1))
        layer.store.put(key, torch.stack([keys, values], dim=2).transpose(0, 1).cpu())
        chunks = -(-prompt_len // CHANNEL_CHUNK)
        by_channel = torch.nn.functional.pad(keys.permute(1, 2, 0),
                                             (0, chunks * CHANNEL_CHUNK - prompt_len))
        layer.store_for((CHANNEL_CHUNK,)).put(
            key, by_channel.reshape(self.shapes.num_kv_heads, -1, CHANNEL_CHUNK).cpu())
        self._absmax[key] = torch.maximum(keys.amax(dim=0), -keys.amin(dim=0)).float()
        self._slot_tokens.pop(key, None)  # a recomputed request
        self._channel_pages.pop(key, None)
        if self.settings.measure_fidelity:
            self._kept[key] = local.expand(self.shapes.num_kv_heads, -1).cpu()

    def decode(self, layer: LayerContext, reqs: list[RequestRows], query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, out: torch.Tensor) -> None:
        if not self.pages.quantized(layer.index):  # fill the slots, then attend every row
            by_k: dict[int, list[RequestRows]] = {}
            for req in reqs:
                by_k.setdefault(self.pages.top_k(req.prompt_len), []).append(req)
            for k, group in by_k.items():
                if k:
                    self._select(layer, group, k, query)
        super().decode(layer, reqs, query, key, value, out)

    def release(self, req_id: str) -> None:
        super().release(req_id)
        for table in (self._absmax, self._slot_tokens, self._channel_pages):
            for k in [k for k in table if k[0] == req_id]:
                del table[k]

    def _selected(self, layer: int, req: RequestRows) -> int:
        return 0  # counted by the fetch: the store rows in the slots (hit rate = slot hits)

    # -- S-layer selection ----------------------------------------------------------------------
    def _select(self, layer: LayerContext, reqs: list[RequestRows], k: int,
                query: torch.Tensor) -> None:
        """The top-k middle tokens per KV head of each request's last committed query row, by
        their partial scores on the critical channels, brought into the request's slots."""
        h, s, device = self.shapes.num_kv_heads, self.settings, query.device
        lens = [r.prompt_len for r in reqs]
        rows = transfer.to_device_async(torch.tensor([r.end - 1 - r.guess for r in reqs]), device)
        prompt_len = transfer.to_device_async(torch.tensor(lens, dtype=torch.int32), device)
        q = query[rows]  # [n, Hq, d]
        keys = [(r.req_id, layer.index) for r in reqs]
        channel_query = self._channel_query(layer, rows, q)
        if channel_query is not q:
            for req in reqs:
                layer.stats(req.req_id).predicted_steps += 1
        channels = critical_channels(channel_query,
                                     torch.stack([self._absmax[key] for key in keys]),
                                     s.critical_channels)
        if ops.reads_channels_in_place(q, layer.store_for((CHANNEL_CHUNK,)).pool):
            wanted = self._top_k_in_place(layer, keys, lens, q, channels, prompt_len, k)
        else:
            scores = self._scores_gathered(layer, keys, lens, q, channels, prompt_len)
            wanted = select_tokens(scores, prompt_len, s.sink, s.recent, k)
        row_bytes = h * s.critical_channels * CHANNEL_CHUNK * self.shapes.elem_bytes
        for req, n in zip(reqs, lens):  # the channel rows read from the store
            layer.stats(req.req_id).bytes_fetched += -(-n // CHANNEL_CHUNK) * row_bytes

        held = held_slots(self._slot_tokens, keys, h, k, device)
        slot_rows = [self._slot_rows(layer, r, k) for r in reqs]
        slots = fetch_into_slots(layer, reqs, held, wanted,
                                 torch.stack([key_rows for key_rows, _ in slot_rows]),
                                 torch.stack([value_rows for _, value_rows in slot_rows]),
                                 self.pages)
        for req, key, tokens in zip(reqs, keys, slots):
            self._slot_tokens[key] = tokens
            if self.settings.measure_fidelity:
                local = self.pages.local_positions(req.prompt_len).expand(h, -1)
                self._kept[key] = torch.cat([local, tokens.clamp(min=0).long().cpu()], dim=1)

    def _channel_query(self, layer: LayerContext, rows: torch.Tensor,
                       q: torch.Tensor) -> torch.Tensor:
        """The query that picks the channels: the layer's own, or in the "predicted" mode the
        one predicted from the previous layer's hidden state (patches/predicted_query.py)."""
        if self.settings.channel_query == "current":
            return q
        from vllm_shadowkv.patches import predicted_query

        predicted = predicted_query.predicted(layer.index)
        return q if predicted is None else predicted[rows].view_as(q)

    def _top_k_in_place(self, layer: LayerContext, keys: list, lens: list[int],
                        q: torch.Tensor, channels: torch.Tensor, prompt_len: torch.Tensor,
                        k: int) -> torch.Tensor:
        """The top-k with the channel rows read where the store keeps them."""
        store = layer.store_for((CHANNEL_CHUNK,))
        offsets, page_start = [], [0]
        for key in keys:
            if key not in self._channel_pages:  # once per request and layer
                self._channel_pages[key] = transfer.to_device_async(store.page_offsets(key),
                                                                    q.device)
            offsets.append(self._channel_pages[key])
            page_start.append(page_start[-1] + len(offsets[-1]))
        page_start = transfer.to_device_async(
            torch.tensor(page_start[:-1], dtype=torch.int32), q.device)
        s = self.settings
        return ops.channel_top_k(q, store.pool, torch.cat(offsets), page_start, channels,
                                 prompt_len, s.sink, s.recent, max(lens), CHANNEL_CHUNK,
                                 store.page_rows, k)

    def _scores_gathered(self, layer: LayerContext, keys: list, lens: list[int],
                         q: torch.Tensor, channels: torch.Tensor,
                         prompt_len: torch.Tensor) -> torch.Tensor:
        """The partial scores over the critical channels' key rows gathered from the store into
        ``[h, d_s, N]``, request b's prompt at columns [key_start[b], + its chunks)."""
        n, h, d = len(keys), self.shapes.num_kv_heads, self.shapes.head_size
        d_s = channels.shape[-1]
        chunks = [-(-length // CHANNEL_CHUNK) for length in lens]
        cpu_channels = channels.long().cpu()
        heads = torch.arange(h).repeat_interleave(d_s)
        ids, counts = [], []
        for request_channels, m in zip(cpu_channels, chunks):
            ids.append((request_channels.view(-1, 1) * m + torch.arange(m)).flatten())
            counts.append(h * d_s * m)
        fetched = torch.empty(sum(counts), CHANNEL_CHUNK, dtype=self.shapes.dtype)
        layer.store_for((CHANNEL_CHUNK,)).gather_many(
            keys, torch.cat([heads.repeat_interleave(m) for m in chunks]), torch.cat(ids), counts,
            fetched)
        fetched = fetched.to(channels.device)
        keys_cm = torch.cat([part.view(h, d_s, -1) for part in fetched.split(counts)], dim=2)
        width = torch.tensor([m * CHANNEL_CHUNK for m in chunks], dtype=torch.int32,
                             device=channels.device)
        key_start = (torch.cumsum(width, 0) - width).to(torch.int32)
        g = q.shape[1] // h
        q_crit = q.view(n, h, g, d).gather(
            3, channels.long().unsqueeze(2).expand(n, h, g, d_s)).reshape(n, h * g, d_s)
        own = torch.arange(d_s, dtype=torch.int32, device=q.device).expand(n, h, d_s)
        s = self.settings
        return ops.channel_scores(q_crit, keys_cm, own.contiguous(), key_start, prompt_len,
                                  s.sink, s.recent, max(lens))

    def _slot_rows(self, layer: LayerContext, req: RequestRows, k: int):
        """Page row ids of the request's slots in this layer, keys and values ``[h, k]``."""
        plan = self._plan(layer, req, self.pages.shape(layer.index, req.prompt_len))
        local = sum(self.pages.local(req.prompt_len))
        return plan.key_rows[:, local:local + k], plan.value_rows[:, local:local + k]
