"""Changes to vLLM's behaviour that no plugin hook allows: one small module each.

Each patch checks that its target still has the shape it was written against and raises
``PatchTargetChanged`` otherwise, so a vLLM upgrade fails loudly at start-up instead of
misbehaving. ``apply_all`` is idempotent: a second call wraps nothing twice.
"""

from vllm_shadowkv.patches import (cpu_backend_selection, cpu_seeded_sampling, guess_config,
                                   guess_row, kernel_warm_up, kv_cache_events, layer_kv_spec,
                                   model_runner_v1, pre_decode, predicted_query,
                                   prefix_cache_hits, runner_requests, startup_validation,
                                   streaming_input)

PATCHES = (cpu_backend_selection, startup_validation, runner_requests, layer_kv_spec,
           model_runner_v1, guess_row, pre_decode, guess_config, predicted_query,
           kernel_warm_up, cpu_seeded_sampling, prefix_cache_hits, kv_cache_events,
           streaming_input)


class PatchTargetChanged(RuntimeError):
    """A patched vLLM function is not the one this patch was written for."""


def apply_all() -> None:
    for patch in PATCHES:
        patch.apply()


def own_attribute(cls, name: str):
    """``cls``'s own ``name`` (not inherited: the patch replaces that class's definition)."""
    try:
        return cls.__dict__[name]
    except KeyError:
        raise PatchTargetChanged(
            f"vllm-shadowkv cannot patch {cls.__name__}.{name}: the class no longer defines "
            f"it. The installed vLLM is not a supported version.") from None


def check_signature(func, expected: list[str], where: str) -> None:
    import inspect

    params = [p for p in inspect.signature(func).parameters if p != "cls"]
    if params != expected:
        raise PatchTargetChanged(
            f"vllm-shadowkv cannot patch {where}: its parameters are {params}, this plugin was "
            f"written for {expected}. The installed vLLM is not a supported version."
        )
