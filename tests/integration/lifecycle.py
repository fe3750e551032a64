"""Lifecycle scenarios for a method on the engine, run in a fresh process with the engine core
in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the scheduler's block pool can be inspected.

usage: lifecycle.py SCENARIO METHOD MODEL RESULT.json    (scenarios: see SCENARIOS)
"""

import json
import random
import sys

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi".split()
MAX_LEN = 1024
KEY_WIDTH = 256  # the tiny model's: 4 KV heads x 64
# Two long (sparse) requests that each generate 600 tokens in a pool sized so that the second is
# admitted next to the first, but their generated pages collide: vLLM preempts the second and
# recomputes it once the first is done.
PREEMPT_PROMPTS = [(52, 7), (54, 8)]  # ~300 tokens each: staging is small next to the growth
PREEMPT_TOKENS = 400


def full(method):
    """The method's covering settings for max_model_len: compressed == dense."""
    from vllm_shadowkv.methods import METHODS

    return METHODS[method].covering_settings(KEY_WIDTH, MAX_LEN) | {"min_sparse_len": 512}


def small_budget(method, budget, min_sparse_len):
    from vllm_shadowkv.methods import METHODS

    return METHODS[method].covering_settings(KEY_WIDTH, budget) | {"min_sparse_len": min_sparse_len}


def page_layout(method, settings, max_len=MAX_LEN):
    """The method's pages on the tiny model (4 layers, 4 KV heads x 64, blocks of 128)."""
    import torch

    from vllm_shadowkv.backend.layout import PageLayout
    from vllm_shadowkv.config import parse_settings
    from vllm_shadowkv.methods import METHODS
    from vllm_shadowkv.methods.base import KVShapes

    cls = METHODS[method]
    shapes = KVShapes(4, 64, torch.bfloat16, 128, num_layers=4, max_model_len=max_len)
    return PageLayout(cls(parse_settings(cls.settings_cls, settings).resolved(shapes), shapes))


def text(num_words, seed):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def engine(model, method, settings=None, **kwargs):
    """An engine running ``method`` (None: vLLM's default backend)."""
    from vllm import LLM

    from vllm_shadowkv.introspect import EXTENSION_CLASS

    extra = {"attention_backend": method,
             "additional_config": {method: settings or full(method)}} if method else {}
    kwargs = {"max_model_len": MAX_LEN, "enable_prefix_caching": False, **kwargs}
    return LLM(model=model, enforce_eager=True, seed=0, worker_extension_cls=EXTENSION_CLASS,
               **extra, **kwargs)


def pool_state(llm):
    core = llm.llm_engine.engine_core.engine_core
    while core.scheduler.has_finished_requests():
        # The step that tells workers which requests finished; vLLM's multiprocess engine core
        # runs it by itself, an in-process engine only when stepped.
        llm.llm_engine.step()
    manager = core.scheduler.kv_cache_manager
    stats = llm.collective_rpc("kv_compression_stats")[0]
    single = [m for m in manager.coordinator.single_type_managers]
    return {
        "free_blocks": manager.block_pool.get_num_free_blocks(),
        "total_blocks": manager.block_pool.num_gpu_blocks,
        "store": stats["store"],
        "compressed_requests": stats["compressed_requests"],
        "manager_tracked": sum(len(getattr(m, "prompt_len", {})) + len(getattr(m, "staging", ()))
                               + len(getattr(m, "store_reserved", {})) for m in single),
        "finished_modes": sorted(s["mode"] for s in stats["finished"].values()),
        "finished_ids": sorted(stats["finished"]),
        "finished_counted": sum(stats["counters"][f"finished_{mode}"]
                                for mode in ("sparse", "dense")),
        "preemptions_counted": sum(s["preemptions"] for s in stats["finished"].values()),
        "suspended": len(stats["suspended"]),
    }


def greedy(llm, prompts, max_tokens, lora_request=None):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    return [
        {"token_ids": list(o.outputs[0].token_ids),
         "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                      for step in o.outputs[0].logprobs]}
        for o in llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    ]


def lora_adapter(path, rank=8):
    """A PEFT LoRA adapter for the tiny model's q, v and o projections, random but fixed."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    shapes = {"q_proj": (1024, 256), "v_proj": (256, 256), "o_proj": (256, 1024)}  # (out, in)
    weights = {}
    for layer in range(4):
        for name, (out, inp) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp) * 0.05
            weights[f"{prefix}.lora_B.weight"] = torch.randn(out, rank) * 0.05
    path.mkdir(exist_ok=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(shapes), "bias": "none"}))
    return str(path)


def preemption(model, method):
    """Too few pages for every request's growth: vLLM preempts and later recomputes."""
    from transformers import AutoTokenizer

    # SpeCache's 1-bit pages hold a request's generated tokens in a few blocks: with slots for
    # the whole prompt, the resident requests are large enough that their growth collides.
    settings = small_budget(method, 768 if method == "specache" else 64, 256)
    prompts = [text(*p) for p in PREEMPT_PROMPTS]
    first, second = (len(AutoTokenizer.from_pretrained(model)(p).input_ids) for p in prompts)
    layout = page_layout(method, settings, max_len=768)
    # Room for the first request compressed and the second while it is compressed (+ the null
    # block and one generated page): both are admitted, then their generated pages collide.
    # (The pool must also hold one max_model_len prompt while it is staged: vLLM's start-up check.)
    max_len = 768
    pool = max(layout.steady_blocks(first) + layout.peak_blocks(second),
               layout.peak_blocks(max_len)) + 2
    small = engine(model, method, settings=settings, num_gpu_blocks_override=pool,
                   max_model_len=max_len, max_num_batched_tokens=256,
                   disable_log_stats=False)  # for get_metrics()
    out = greedy(small, prompts, PREEMPT_TOKENS)
    metrics = {m.name: getattr(m, "value", None) for m in small.get_metrics()}
    result = {"outputs": out, "preemptions": metrics.get("vllm:num_preemptions"),
              "after": pool_state(small)}
    del small
    return result


def abort(model, method):
    """Requests aborted mid-generation (one long, sparse; one short) give everything back."""
    from vllm import SamplingParams

    llm = engine(model, method, max_num_batched_tokens=256)
    before = pool_state(llm)
    eng = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    for i, prompt in enumerate([text(120, 1), "short one", text(130, 2), "another"]):
        eng.add_request(f"r{i}", prompt, params)
    finished, steps = set(), 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished.add(out.request_id)
        steps += 1
        if steps == 12:
            eng.abort_request(["r0", "r1"])
    return {"before": before, "after": pool_state(llm), "finished": sorted(finished)}


def store_full(model, method):
    """The value store holds one long request's values, not two: the second waits its turn."""
    prompts = [text(130, 3), text(140, 4)]  # ~750 tokens each
    # A store that holds one request of at most MAX_LEN tokens, not two of 750 (tiny model:
    # ShadowKV 2 KiB of values per compressed token, 2 MiB; SpeCache keys too, 4 MiB)
    llm = engine(model, method, settings={**full(method),
                                          "value_store_gib": one_request_store_gib(method)})
    out = greedy(llm, prompts, 24)
    return {"outputs": out, "after": pool_state(llm)}


def one_request_store_gib(method) -> float:
    return max(page_layout(method, full(method)).store_bytes(MAX_LEN), 1 << 20) / 2**30


def reference(model, method=None):
    """The default backend on the prompts of the other scenarios."""
    llm = engine(model, None)
    return {"store_full": greedy(llm, [text(130, 3), text(140, 4)], 24)}


def thousand_requests(model, method):
    """1,000 mixed requests in waves: the block pool and the store end as they started."""
    llm = engine(model, method, settings=small_budget(method, 128, 512),
                 max_num_batched_tokens=2048)
    before = pool_state(llm)
    rng = random.Random(0)
    from vllm import SamplingParams

    for wave in range(10):
        prompts, params = [], []
        for i in range(100):
            n = wave * 100 + i
            long = n % 50 == 7
            prompts.append(text(100, n) if long else text(rng.randint(1, 40), n))
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 6)))
        llm.generate(prompts, params, use_tqdm=False)
    return {"before": before, "after": pool_state(llm)}


def seeded_sampling(model, method):
    """A seeded request sampled alone (its prompt in one step) and again behind a prompt that
    pushes its prefill into two steps, the first one's token discarded: on the CPU that
    discard killed the engine (patches/cpu_seeded_sampling.py)."""
    from vllm import SamplingParams

    llm = engine(model, method, max_num_batched_tokens=1024)
    # ~750 tokens (sparse) and ~400 (dense: a second long prompt would wait for the staging)
    request, filler = text(130, 5), text(70, 6)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    unseeded = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([request], seeded, use_tqdm=False)[0]
    behind = llm.generate([filler, request], [unseeded, seeded], use_tqdm=False)[1]
    return {"alone": list(alone.outputs[0].token_ids), "behind": list(behind.outputs[0].token_ids),
            "after": pool_state(llm)}


def serving_features(model, method):
    """A long (compressed) and a short request with a LoRA adapter and without, mixed in one
    batch; parallel sampling (n=2); structured output (a choice). ``none``: vLLM's default."""
    from pathlib import Path

    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import StructuredOutputsParams

    # Prompts in one step each: vLLM's default backend dies on a seeded chunked prefill on the
    # CPU (patches/cpu_seeded_sampling.py). Two LoRA slots: with one, vLLM 0.32's CPU runner
    # applies the adapter to the base requests of a mixed batch too, under any backend.
    llm = engine(model, None if method == "none" else method, enable_lora=True, max_lora_rank=8,
                 max_loras=2)
    lora = LoRARequest("adapter", 1, lora_adapter(Path("adapter")))
    prompts = [text(130, 11), text(12, 12)]  # ~750 tokens (sparse) and ~70 (dense)
    sampled = llm.generate(prompts[:1], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8,
                                                       ignore_eos=True), use_tqdm=False)[0]
    choices = ["alpha beta gamma", "delta epsilon"]
    chosen = llm.generate(prompts[:1], SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=choices)),
        use_tqdm=False)[0]
    return {"base": greedy(llm, prompts, 16), "lora": greedy(llm, prompts, 16, lora),
            "mixed": greedy(llm, prompts, 16, [lora, None]),
            "n2": [len(c.token_ids) for c in sampled.outputs], "choice": chosen.outputs[0].text,
            "choices": choices, "after": pool_state(llm) if method != "none" else None}


def random_load(model, method):
    """Sixty requests arriving at random in a pool two blocks larger than one staged prompt:
    long (compressed) and short prompts, greedy and seeded sampling, outputs of 1-200 tokens,
    a few aborts; vLLM preempts and recomputes. Everything not aborted finishes and the pool and
    the store end empty. Lengths are fixed (ignore_eos), so the schedule is the same on any
    machine. ``specache+speculative``: SpeCache with its guess row (speculative decoding);
    ``+prefix``: with prefix caching, the long prompts starting with one of two prefixes, and
    the prefix cache reset halfway with the running requests preempted (what RL frameworks do
    after a weight update) and again at the end."""
    from vllm import SamplingParams

    method, *options = method.split("+")
    settings = small_budget(method, 64, 256) | {"max_staging_requests": 2}
    settings |= {"prefetch": "speculative"} if "speculative" in options else {}
    prefix = "prefix" in options
    staged = page_layout(method, settings).peak_blocks(MAX_LEN)
    llm = engine(model, method, settings=settings, max_num_batched_tokens=256, max_num_seqs=8,
                 num_gpu_blocks_override=staged + 2, enable_prefix_caching=prefix,
                 disable_log_stats=False)  # for get_metrics()
    eng, rng = llm.llm_engine, random.Random(1)
    added, live, finished, aborted, resets = 0, set(), [], [], []
    while added < 60 or eng.has_unfinished_requests():
        if prefix and added == 30 and not resets and len(live) > 1:
            resets.append(llm.reset_prefix_cache(reset_running_requests=True))
        if added < 60 and rng.random() < 0.5:
            long = rng.random() < 0.4
            if long and prefix:
                prompt = f"{text(70, rng.randint(1, 2))} {text(rng.randint(1, 80), 100 + added)}"
            else:
                prompt = text(rng.randint(60, 150) if long else rng.randint(1, 30), 100 + added)
            params = SamplingParams(temperature=rng.choice([0, 0.8]),
                                    seed=rng.choice([None, added]),
                                    max_tokens=rng.randint(1, 200), ignore_eos=True)
            eng.add_request(f"r{added}", prompt, params)
            live.add(f"r{added}")
            added += 1
        if live and rng.random() < 0.004:
            victim = rng.choice(sorted(live))
            eng.abort_request([victim])
            live.discard(victim)
            aborted.append(victim)
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
                finished.append(out.request_id)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    after = pool_state(llm)
    if prefix:
        resets.append(llm.reset_prefix_cache())
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        resets.append(len(pool.cached_block_hash_to_block))
    return {"finished": finished, "aborted": aborted, "after": after, "resets": resets,
            "metrics": {k: v for k, v in metrics.items() if k in (
                "vllm:num_preemptions", "vllm:spec_decode_num_drafts",
                "vllm:spec_decode_num_accepted_tokens", "vllm:prefix_cache_hits")}}


SCENARIOS = {f.__name__: f for f in (preemption, abort, store_full, reference, thousand_requests,
                                     seeded_sampling, random_load, serving_features)}

if __name__ == "__main__":
    scenario, method, model, out = sys.argv[1:5]
    json.dump(SCENARIOS[scenario](model, method), open(out, "w"))
