"""Per-worker state of the engine: which requests are in the batch, the host store, the stats.

vLLM's attention metadata has no request ids or prompt lengths, and a backend is not told when a
request finishes, is aborted or is preempted. ``patches/runner_requests.py`` hands this module
the model runner each step, and the ids to release, before the runner updates its batch.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm_shadowkv.config import Stamp, human_bytes, stamp_of
from vllm_shadowkv.store import CpuValueStore

# Set by the plugin in the front end; spawned workers inherit it, and vLLM copies it to its Ray
# workers (metrics.ensure_stats_dir names it in VLLM_RAY_EXTRA_ENV_VARS_TO_COPY).
STATS_DIR_ENV = "SHADOWKV_STATS_DIR"
LOG_EVERY_S = 10.0
# The snapshot file at once when requests start or finish; when only the counters of running
# requests grew, at most this often (writing it every step cost 0.5-0.8 ms of a decode step).
WRITE_EVERY_S = 1.0
LIFECYCLE = ("running_sparse", "running_dense", "finished_sparse", "finished_dense")
TRAFFIC = ("selected", "hits", "bytes_fetched")  # cumulative selection traffic of requests


@dataclass(frozen=True)
class EngineFacts:
    """What the page format needs from the engine config, captured while the model is built
    (vLLM asks backends for their KV spec later, outside its config context)."""

    stamp: Stamp
    max_model_len: int
    num_layers: int  # attention layers on this worker
    data_parallel_rank: int = 0  # the engine this worker belongs to, for the metrics

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "EngineFacts":
        stamp = stamp_of(vllm_config)
        if stamp is None:
            raise RuntimeError("vllm-shadowkv: the engine backend was built without the front "
                               "end's start-up check (no method stamp in additional_config); "
                               "select a method with --attention-backend (shadowkv, minikv, "
                               "specache, tailorkv) and install the plugin where the front "
                               "end runs, so that vLLM loads it there too")
        model_config = vllm_config.model_config
        parallel = vllm_config.parallel_config
        return cls(stamp=stamp, max_model_len=model_config.max_model_len,
                   num_layers=model_config.get_num_layers(parallel),
                   # the engine's index: dense models' DP engines run as DP=1 with rank 0
                   data_parallel_rank=getattr(parallel, "data_parallel_index",
                                              parallel.data_parallel_rank))


@dataclass
class RequestStats:
    """What one request did on this worker: its mode and, when sparse, its selection traffic."""

    mode: str = "dense"  # "dense" (exact attention) or "sparse" (compressed by the method)
    prompt_len: int = 0
    decode_steps: int = 0  # compressed decode calls, over layers
    preemptions: int = 0  # times vLLM preempted it (each time it was recomputed from scratch)
    selected: int = 0  # selected store rows (ShadowKV: chunks), over KV heads and layers
    hits: int = 0  # of which resident from the previous step
    bytes_fetched: int = 0  # moved from the host store
    # SpeCache's speculative prefetch with measure_fidelity: the top-k tokens the output rows
    # would have picked themselves, and of those, the ones the previous guess row fetched
    speculated: int = 0
    speculation_hits: int = 0
    pre_decode_steps: int = 0  # SpeCache's pre-decoding calls (tokens dropped), over layers
    # SpeCache's speculative calls whose output row also picked its own top-k and fetched in
    # line what the guess had not (verify_guess), over layers
    verified_steps: int = 0
    # TailorKV's "predicted" channel query: S-layer decode calls whose channels came from the
    # previous layer's hidden state (0 where the hook gave nothing and the layer's own query
    # picked them)
    predicted_steps: int = 0
    # measure_fidelity only: layer -> [sum of relative errors, sum of chunk recalls, steps]
    fidelity: dict[int, list[float]] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.selected if self.selected else 0.0

    @property
    def speculation_hit_rate(self) -> float:
        return self.speculation_hits / self.speculated if self.speculated else 0.0

    def record_fidelity(self, layer: int, relative_error: float, chunk_recall: float) -> None:
        sums = self.fidelity.setdefault(layer, [0.0, 0.0, 0])
        sums[0] += relative_error
        sums[1] += chunk_recall
        sums[2] += 1

    def fidelity_means(self) -> dict[int, dict[str, float]]:
        return {layer: {"relative_error": e / n, "chunk_recall": r / n, "steps": n}
                for layer, (e, r, n) in self.fidelity.items()}


@dataclass
class WorkerState:
    engine: EngineFacts | None = None
    _config_ref: weakref.ref | None = None  # the VllmConfig of the engine ``engine`` describes
    runner_ref: weakref.ref | None = None
    _stores: dict = field(default_factory=dict)  # row shape -> CpuValueStore
    methods: set = field(default_factory=set)  # the KVMethod of each layer (EngineImpl._context)
    # request id -> layers whose prompt is compressed (values in the store)
    compressed: dict[str, set[int]] = field(default_factory=dict)
    requests: dict[str, RequestStats] = field(default_factory=dict)
    # Preempted requests waiting to be recomputed: their stats carry on when they resume
    suspended: dict[str, RequestStats] = field(default_factory=dict)
    # This step's guess rows per request id (SpeCache's second query row, never committed):
    # the scheduled draft tokens when the runner's drafter is the guess proposer that rejects
    # every guess. Other drafts may be accepted, so their rows are written like any other.
    guesses: dict[str, int] = field(default_factory=dict)
    # measure_fidelity only: (request id, layer) -> exact prompt (keys, values) in host memory
    reference_kv: dict = field(default_factory=dict)
    finished: deque = field(default_factory=lambda: deque(maxlen=1024))  # (req_id, stats)
    totals: Counter = field(default_factory=Counter)  # of released requests, for metrics
    _last_log: float = 0.0
    _last_write: float = 0.0
    _written: dict = field(default_factory=dict)
    _stats_file_failed: bool = False

    def begin_engine(self, facts: EngineFacts, vllm_config) -> None:
        """Called by each layer's impl as its engine builds the model. The first layer of another
        engine (a second ``LLM`` in this process with VLLM_ENABLE_V1_MULTIPROCESSING=0) starts
        from an empty state: the previous engine's stores (sized by its settings), methods (and
        the pages they hold), requests and counters must not carry over. The state is the
        process's: two plugin engines used in turn in one process are not supported (vLLM's
        default multiprocessing gives each engine its own worker processes)."""
        if self._config_ref is None or self._config_ref() is not vllm_config:
            self._reset()
            self._config_ref = weakref.ref(vllm_config)
        self.engine = facts

    def attach(self, runner) -> None:
        """Each step, before the runner updates its batch (``patches/runner_requests.py``). A
        new runner of an engine without the plugin's methods (another backend's engine after a
        plugin one, in one process) drops the earlier engine's state: its host store would
        stay allocated and its counters reported."""
        if self.runner_ref is None or self.runner_ref() is not runner:
            if self.engine is not None and stamp_of(runner.vllm_config) is None:
                self._reset()
        self.runner_ref = weakref.ref(runner)

    def _reset(self) -> None:
        """Every field back to its default, in place (the backend imports this object)."""
        self.__dict__.update(WorkerState().__dict__)

    def store(self, method, layer: int = 0) -> CpuValueStore:
        """This worker's host store for the method's rows in ``layer``, created on first use
        with the front end's capacity (its pages are allocated lazily up to that bound, pinned
        on CUDA). Rows of another shape get their own pool; admission bounds the total."""
        return self.store_for(method.store_row_shape(layer), method.shapes.dtype)

    def store_for(self, row_shape: tuple[int, ...], dtype) -> CpuValueStore:
        if row_shape not in self._stores:
            self._stores[row_shape] = CpuValueStore(
                capacity_bytes=self.engine.stamp.store_bytes, dtype=dtype, row_shape=row_shape)
        return self._stores[row_shape]

    @property
    def _store_totals(self) -> tuple[int, int]:
        """(used, capacity) bytes of the host store."""
        used = sum(s.used_bytes for s in self._stores.values())
        return used, self.engine.stamp.store_bytes if self.engine else 0

    @property
    def runner(self):
        runner = self.runner_ref() if self.runner_ref is not None else None
        if runner is None:
            raise RuntimeError("shadowkv: the model runner was not registered (patch missing)")
        return runner

    def batch_requests(self, num_reqs: int) -> tuple[list[str], list[int]]:
        """Request ids and prompt lengths of the rows of this step's attention metadata. Before
        the runner's first step (memory profiling, warm-up, CUDA-graph capture) no request was
        ever scheduled: every row is a dummy, and none is returned."""
        if self.runner_ref is None:
            return [], []
        batch = self.runner.input_batch
        return list(batch.req_ids[:num_reqs]), batch.num_prompt_tokens[:num_reqs].tolist()

    def request(self, req_id: str, prompt_len: int, sparse: bool) -> RequestStats:
        """The request's stats, created the first time a layer sees it (or taken back from
        before its preemption)."""
        stats = self.requests.get(req_id)
        if stats is None:
            stats = self.suspended.pop(req_id, None)
            if stats is None:
                stats = RequestStats(mode="sparse" if sparse else "dense", prompt_len=prompt_len)
            self.requests[req_id] = stats
        return stats

    def release(self, ended: Iterable[str], suspended: Iterable[str] = ()) -> None:
        """The requests' rows leave the host store. ``ended`` (finished or aborted) are counted
        as finished; ``suspended`` (preempted, or resumed: recomputed from scratch) keep their
        stats for when they run again, so a preempted request is counted once."""
        for req_id in suspended:
            self._free(req_id)
            stats = self.requests.pop(req_id, None)
            if stats is not None:
                stats.preemptions += 1
                self.suspended[req_id] = stats
        for req_id in ended:
            self._free(req_id)
            stats = self.requests.pop(req_id, None) or self.suspended.pop(req_id, None)
            if stats is not None:
                self.finished.append((req_id, stats))
                self.totals[f"finished_{stats.mode}"] += 1
                for key in TRAFFIC:
                    self.totals[key] += getattr(stats, key)

    def _free(self, req_id: str) -> None:
        for method in self.methods:
            method.release(req_id)
        for layer in self.compressed.pop(req_id, ()):
            for store in self._stores.values():
                store.free((req_id, layer))
            self.reference_kv.pop((req_id, layer), None)

    def snapshot(self) -> dict:
        """Counters and gauges for metrics: cumulative over all requests, live ones included."""
        live = Counter(s.mode for s in self.requests.values())
        used, capacity = self._store_totals
        snap = {
            "method": self.engine.stamp.method,
            "running_sparse": live["sparse"], "running_dense": live["dense"],
            "finished_sparse": self.totals["finished_sparse"],
            "finished_dense": self.totals["finished_dense"],
            "store_used_bytes": used, "store_capacity_bytes": capacity,
            "data_parallel_rank": self.engine.data_parallel_rank,
        }
        unfinished = [*self.requests.values(), *self.suspended.values()]
        for key in TRAFFIC:
            snap[key] = self.totals[key] + sum(getattr(s, key) for s in unfinished)
        return snap

    def report(self, logger) -> None:
        """Called once per engine step: when the counters changed, a snapshot file for the
        server's Prometheus collector (``metrics.py``; see WRITE_EVERY_S), and a log line at
        most every LOG_EVERY_S. Silent when none of the plugin's methods runs on this worker."""
        if self.engine is None:
            return
        snap = self.snapshot()
        now = time.monotonic()
        if snap == self._written or (
                all(snap[k] == self._written.get(k) for k in LIFECYCLE)
                and now - self._last_write < WRITE_EVERY_S):
            return
        self._written, self._last_write = snap, now
        stats_dir = os.environ.get(STATS_DIR_ENV)
        if stats_dir and not self._stats_file_failed:
            self._write_snapshot(stats_dir, snap, logger)
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            hit_rate = snap["hits"] / snap["selected"] if snap["selected"] else 0.0
            logger.info(
                "%s: running %d compressed / %d exact, finished %d compressed / %d exact; "
                "hit rate %.1f%%; fetched %.1f MiB; host store %s of %s", snap["method"],
                snap["running_sparse"], snap["running_dense"], snap["finished_sparse"],
                snap["finished_dense"], 100 * hit_rate, snap["bytes_fetched"] / (1 << 20),
                human_bytes(snap["store_used_bytes"]), human_bytes(snap["store_capacity_bytes"]))

    def _write_snapshot(self, stats_dir: str, snap: dict, logger) -> None:
        """The metrics are a side channel: a directory that is missing here (a Ray worker on
        another node gets the front end's path), unwritable or full turns them off for this
        worker, with one warning, and never fails the step that serves the requests."""
        path = os.path.join(stats_dir, f"worker-{os.getpid()}.json")
        try:
            os.makedirs(stats_dir, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(snap, f)
            os.replace(path + ".tmp", path)
        except OSError as err:
            self._stats_file_failed = True
            logger.warning("%s: cannot write this worker's metrics to %s (%s); its counters are "
                           "left out of /metrics (requests are served the same)",
                           snap["method"], stats_dir, err)


STATE = WorkerState()
