"""Build a vLLM engine in this (fresh) process, generate greedily, write JSON. With
VLLM_ENABLE_V1_MULTIPROCESSING=0 (tests/engine_utils.py sets it for one-rank engines) the engine
core and worker run here too; otherwise in vLLM's own processes.

usage: generate.py REQUEST.json RESULT.json
REQUEST: {"model", "attention_backend" (or null), "batches": [[prompt, ...], ...],
          "max_tokens", "ignore_eos" (optional), "engine_kwargs": {...}}
RESULT:  {"backends": {layer: backend name}, "runner": {"class", "v1", ...},
          "batches": [[{"token_ids", "logprobs"}, ...], ...],
          "rank_backends": [{layer: backend name} of each rank],
          "rank_runners": [runner of each rank], "start_s": engine start time,
          "stats": [kv_compression_stats of rank 0 after each batch] (plugin methods only),
          "rank_stats": [[kv_compression_stats of each rank] after each batch] (plugin methods only),
          "spec_decode": {counter: value} at the end (with disable_log_stats False in
          engine_kwargs; speculative decoding set by the user or by the plugin),
          "prefix_cache": {"queries", "hits"} in tokens at the end (the same condition),
          and with "follow_up": true in REQUEST one more batch: each prompt of the last batch
          followed by its answer and its first 8 tokens again (the next turn of a chat),
          "host_waits": [{"layer", "reads", "copies"} per decode-only layer call] (with
          "count_host_waits": true in REQUEST),
          "kv_events": [{"type": "stored" | "removed" | "cleared", "block_hashes", "parent",
          "tokens"} as a KV-aware router receives them over vLLM's ZMQ publisher] (with
          "kv_events": true in REQUEST)}
"""

import json
import os
import sys
import time

HOST_WAITS = "host_waits.jsonl"  # in the working directory, one line per counted call


def count_host_waits() -> None:
    """Each attention layer's call in a step without prefill rows, counted by
    tests/host_waits.py (the reads of device data and the HostCopy round trips), one JSON line
    each in HOST_WAITS. The engine core runs in this process, where the patch is."""
    from pathlib import Path

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from host_waits import HostWaits

    from vllm_shadowkv.backend.attention import EngineImpl

    run = EngineImpl._run

    def counted(self, m, ctx, query, key, value, out):
        rows = [(m.query_start_loc[i + 1] - m.query_start_loc[i], m.seq_lens[i], m.prompt_lens[i])
                for i, r in enumerate(m.req_ids) if r is not None]
        if not rows or any(seq - n < prompt for n, seq, prompt in rows):
            return run(self, m, ctx, query, key, value, out)
        with HostWaits() as waits:
            run(self, m, ctx, query, key, value, out)
        with open(HOST_WAITS, "a") as f:
            f.write(json.dumps({"layer": ctx.index, "reads": waits.reads,
                                "copies": waits.copies}) + "\n")

    EngineImpl._run = counted


class KVEventSubscriber:
    """What a KV-aware router receives: vLLM's ZMQ publisher on an IPC endpoint of the working
    directory, subscribed before the engine starts (vLLM binds it)."""

    def __init__(self) -> None:
        import zmq

        self.endpoint = f"ipc:///tmp/vllm-shadowkv-kv-events-{os.getpid()}"  # short: a socket path
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.connect(self.endpoint)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")

    def config(self):
        from vllm.config import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                              endpoint=self.endpoint)

    def drain(self, quiet_s: float = 2.0) -> list[dict]:
        import msgspec
        from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                                KVEventBatch)

        decoder, events = msgspec.msgpack.Decoder(type=KVEventBatch), []
        while self.socket.poll(int(quiet_s * 1000)):
            _, _, payload = self.socket.recv_multipart()
            for event in decoder.decode(payload).events:
                if isinstance(event, BlockStored):
                    events.append({"type": "stored", "block_hashes": event.block_hashes,
                                   "parent": event.parent_block_hash,
                                   "tokens": list(event.token_ids)})
                elif isinstance(event, BlockRemoved):
                    events.append({"type": "removed", "block_hashes": event.block_hashes})
                elif isinstance(event, AllBlocksCleared):
                    events.append({"type": "cleared"})
        return events


if __name__ == "__main__":  # vLLM spawns its engine core: keep the entry point guarded
    from vllm import LLM, SamplingParams

    from vllm_shadowkv.introspect import EXTENSION_CLASS

    request = json.loads(open(sys.argv[1]).read())
    if request.get("count_host_waits"):
        count_host_waits()
    engine_kwargs = request.get("engine_kwargs", {})
    if request.get("kv_events"):
        subscriber = KVEventSubscriber()
        engine_kwargs = {**engine_kwargs, "kv_events_config": subscriber.config()}
    start = time.monotonic()
    llm = LLM(
        model=request["model"],
        attention_backend=request.get("attention_backend"),
        worker_extension_cls=EXTENSION_CLASS,
        enforce_eager=True,
        seed=0,
        **engine_kwargs,
    )
    start_s = time.monotonic() - start
    params = SamplingParams(temperature=0.0, max_tokens=request.get("max_tokens", 16), logprobs=5,
                            ignore_eos=request.get("ignore_eos", False))
    rank_backends = llm.collective_rpc("kv_compression_backends")
    rank_runners = llm.collective_rpc("kv_compression_runner")
    result = {"backends": rank_backends[0], "rank_backends": rank_backends, "start_s": start_s,
              "runner": rank_runners[0], "rank_runners": rank_runners, "batches": []}
    batches, outputs = list(request["batches"]), []
    if request.get("follow_up"):
        batches.append("follow_up")
    for prompts in batches:
        if prompts == "follow_up":  # the next turn of a chat: the last turn, its answer, more
            from vllm.inputs import TokensPrompt

            prompts = [TokensPrompt(prompt_token_ids=[*o.prompt_token_ids,
                                                      *o.outputs[0].token_ids,
                                                      *o.prompt_token_ids[:8]])
                       for o in outputs]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            # In-process, the step that hands the worker the finished requests (the engine
            # core's busy loop runs it in its own process) runs here.
            llm.llm_engine.step()
        if request.get("attention_backend"):
            ranks = llm.collective_rpc("kv_compression_stats")
            result.setdefault("stats", []).append(ranks[0])
            result.setdefault("rank_stats", []).append(ranks)
        result["batches"].append([
            {
                "token_ids": list(o.outputs[0].token_ids),
                "logprobs": [
                    {str(tok): lp.logprob for tok, lp in step.items()}
                    for step in o.outputs[0].logprobs
                ],
            }
            for o in outputs
        ])
    if request.get("engine_kwargs", {}).get("disable_log_stats") is False:
        from vllm.v1.metrics.reader import Counter

        counters = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter)}
        result["spec_decode"] = {name: value for name, value in counters.items()
                                 if name.startswith("vllm:spec_decode")}
        result["prefix_cache"] = {name.removeprefix("vllm:prefix_cache_"): value
                                  for name, value in counters.items()
                                  if name.startswith("vllm:prefix_cache_")}
    if request.get("count_host_waits"):
        result["host_waits"] = [json.loads(line) for line in open(HOST_WAITS)]
    if request.get("kv_events"):
        result["kv_events"] = subscriber.drain()
    open(sys.argv[2], "w").write(json.dumps(result))
