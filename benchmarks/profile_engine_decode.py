"""cProfile of decode steps inside a real vLLM engine (engine core in-process), one request or a
batch of them (``--requests``).

  .venv/bin/python benchmarks/profile_engine_decode.py --method minikv --context 8192 \\
      --out benchmarks/profiles/minikv_decode_8k.txt

The model defaults to the local Llama-3.1-8B-shape model (2 layers). The prompt (random token
ids) is prefilled (in chunks, as the scheduler splits it), 3 decode steps warm the compiled
kernels, then ``--steps`` decode steps run under cProfile. With ``--prefill``, the prefill
steps are profiled instead (up to every request's first token, after a 1K-token request has
warmed the engine): where a method's TTFT goes. Written: ms per step (cProfile's overhead
included), the functions by cumulative time and by their own time. For where the time goes,
not for ratios (benchmarks/throughput.py). With ``--wall`` no profiler runs: the ms per step and
per attention layer (the backend's KV write and attention calls, this package's or vLLM's CPU
backend's), by the clock.
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import time
from pathlib import Path

from vllm_shadowkv.cpu_cores import engine_cores_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="shadowkv", help="a method, or 'default'")
    parser.add_argument("--settings", default='{"min_sparse_len": 1024}', help="JSON")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--requests", type=int, default=1, help="decoding side by side")
    parser.add_argument("--model", default=None, help="default: the local llama8b-shape model")
    parser.add_argument("--prefill", action="store_true",
                        help="profile the prefill steps, not decode steps")
    parser.add_argument("--wall", action="store_true",
                        help="no profiler: wall time per step and per attention layer")
    parser.add_argument("--dtype", default="auto",
                        help="the model's dtype (float32 on CPUs without AVX512-BF16)")
    parser.add_argument("--threads", type=int, default=0,
                        help="cores of the engine (0: all of this process's)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ.update(engine_cores_env(args.threads))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_shadowkv.introspect import EXTENSION_CLASS
    from vllm_shadowkv.models import build_model

    model = args.model or str(build_model("llama8b-shape"))
    kwargs = {}
    if args.method != "default":
        kwargs = {"attention_backend": args.method, "worker_extension_cls": EXTENSION_CLASS,
                  "additional_config": {args.method: json.loads(args.settings)}}
    llm = LLM(model=model, max_model_len=args.context + args.steps + 8, enforce_eager=True,
              enable_prefix_caching=False, seed=0, dtype=args.dtype,
              kv_cache_memory_bytes=args.requests * (400 << 20), **kwargs)
    engine = llm.llm_engine
    rng = random.Random(args.context)

    def add(req_id: str, length: int, max_tokens: int) -> None:
        prompt = TokensPrompt(prompt_token_ids=[rng.randrange(256) for _ in range(length)])
        engine.add_request(req_id, prompt, SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True))

    if args.prefill:
        add("warm", 1024, 2)
        while engine.has_unfinished_requests():
            engine.step()
    for i in range(args.requests):
        add(f"r{i}", args.context, args.steps + 5)
    generated: dict[str, int] = {}  # tokens so far, per request

    def step() -> None:
        generated.update({out.request_id: len(out.outputs[0].token_ids) for out in engine.step()})

    def prefilled() -> bool:
        return len(generated) == args.requests and min(generated.values()) > 0

    if not args.prefill:  # the prefills (several steps when chunked), then 3 decode steps
        while not prefilled() or min(generated.values()) < 4:
            step()
    attention = _time_attention(args.method)  # from here on
    profiler = None if args.wall else cProfile.Profile()
    start, steps = time.perf_counter(), 0
    if profiler:
        profiler.enable()
    while engine.has_unfinished_requests() and (not prefilled() if args.prefill
                                                 else steps < args.steps):
        step()
        steps += 1
    per_step = 1000 * (time.perf_counter() - start) / steps
    text = io.StringIO()
    if profiler:
        profiler.disable()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(40)  # where the time is spent, op by op
    layers = attention[1] / steps
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(f"{args.method} at {args.context} tokens x {args.requests} requests, "
                        f"settings {args.settings}: "
                        f"{per_step:.1f} ms per {'prefill' if args.prefill else 'decode'} step "
                        f"over {steps} steps ({'wall' if args.wall else 'under cProfile'}); "
                        f"attention {1000 * attention[0] / steps:.1f} ms of it, "
                        f"{1e6 * attention[0] / steps / layers:.0f} us per layer"
                        f"\n{text.getvalue()}")
    print(f"{per_step:.1f} ms per step; wrote {args.out}")


def _time_attention(method: str) -> list:
    """Adds up the wall time of the attention backend's calls (KV write and attention) into
    [seconds, attention calls]."""
    if method == "default":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as impl
    else:
        from vllm_shadowkv.backend.attention import EngineImpl as impl
    total = [0.0, 0]

    def timed(call, counted: bool):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - start
                total[1] += counted
        return run

    impl.forward = timed(impl.forward, True)
    impl.do_kv_cache_update = timed(impl.do_kv_cache_update, False)
    return total


if __name__ == "__main__":
    main()
