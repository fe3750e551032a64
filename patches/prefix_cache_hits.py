"""End a compressed request's prefix-cache hit before its prompt does; tell the manager the
request's prompt length.

vLLM looks a request up to its last token but one. For a request recomputed after preemption
that covers its generated tokens too, but a compressed request must prefill its prompt's last
token itself: that step compresses the prompt (``CompressedKVManager.within_prompt``). Only
``KVCacheManager.get_computed_blocks`` sees the request, so it cuts the hit there. It is also
the one call that sees every waiting request before vLLM checks that its whole sequence fits
(``full_sequence_must_fit``), which comes before ``remove_skipped_blocks`` tells the manager the
prompt length. The check's own prefill end is ``max(prompt, tokens - 1)``: for a request
recomputed after preemption that counts its output as prompt, and the manager sized it as
exact pages of its whole sequence.
"""

from __future__ import annotations

_EXPECTED = ["self", "request"]


def apply() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from vllm_shadowkv.patches import check_signature

    original = KVCacheManager.get_computed_blocks
    if getattr(original, "_shadowkv_original", None) is not None:
        return
    check_signature(original, _EXPECTED, "KVCacheManager.get_computed_blocks")

    def get_computed_blocks(self, request):
        from vllm_shadowkv.backend.kv_spec import CompressedKVManager

        blocks, hit_length, boundary = original(self, request)
        managers = self.coordinator.single_type_managers
        for manager in managers:
            if isinstance(manager, CompressedKVManager):
                manager.prompt_len[request.request_id] = request.num_prompt_tokens
        if hit_length and isinstance(managers[0], CompressedKVManager):
            pages, hit_length = managers[0].within_prompt(blocks.blocks[0], hit_length,
                                                          request.num_prompt_tokens)
            blocks = self.create_kv_cache_blocks((pages,))
        return blocks, hit_length, boundary

    get_computed_blocks._shadowkv_original = original
    KVCacheManager.get_computed_blocks = get_computed_blocks
