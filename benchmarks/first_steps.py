"""Start-up time and the wall time of each engine step of the first compressed requests.

  .venv/bin/python benchmarks/first_steps.py --method tailorkv \\
      --settings '{"q_layers": [0], "min_sparse_len": 1024}' \\
      --out benchmarks/first_steps/tailorkv.json

A real vLLM engine (engine core in-process, ``enforce_eager``), the local tiny model by default:
two prompts of ``--context`` and ``--context`` - 100 random tokens, ``--tokens`` greedy output
tokens each, stepped one engine step at a time. What a kernel compiled on first use costs shows
as seconds inside the first decode steps; compiled at start-up (backend/warm_up.py), it shows in
the start-up time instead. Written: start-up seconds and every step's milliseconds (JSON).
"""

import argparse
import json
import os
import random
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="shadowkv")
    parser.add_argument("--settings", default='{"min_sparse_len": 1024}', help="JSON")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--model", default="tiny", help="a local model name or a directory")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process

    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_shadowkv.introspect import EXTENSION_CLASS
    from vllm_shadowkv.models import build_model, model_names

    model = str(build_model(args.model)) if args.model in model_names() else args.model
    start = time.perf_counter()
    llm = LLM(model=model, max_model_len=args.context + args.tokens + 8, enforce_eager=True,
              enable_prefix_caching=False, seed=0, kv_cache_memory_bytes=400 << 20,
              attention_backend=args.method, worker_extension_cls=EXTENSION_CLASS,
              additional_config={args.method: json.loads(args.settings)})
    startup = time.perf_counter() - start
    engine, rng = llm.llm_engine, random.Random(0)
    for i, n in enumerate((args.context, args.context - 100)):
        prompt = TokensPrompt(prompt_token_ids=[rng.randrange(256) for _ in range(n)])
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=args.tokens,
                                                           ignore_eos=True))
    steps = []
    with tqdm(desc="engine steps", unit="step") as bar:
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            steps.append(round(1000 * (time.perf_counter() - t0), 1))
            bar.update()
    result = {"method": args.method, "settings": json.loads(args.settings), "model": args.model,
              "context": args.context, "startup_s": round(startup, 1), "step_ms": steps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"start-up {startup:.1f} s; steps (ms): {steps}")


if __name__ == "__main__":
    main()
