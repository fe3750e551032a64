"""Per-worker engine state without an engine."""

from types import SimpleNamespace


def engine_facts(store_bytes: int, rank: int = 0) -> SimpleNamespace:
    """What the state reads of ``EngineFacts``: the method, the store size, the engine's rank."""
    return SimpleNamespace(stamp=SimpleNamespace(method="shadowkv", store_bytes=store_bytes),
                           data_parallel_rank=rank)


def test_rows_before_the_first_step_are_dummies():
    """Memory profiling and warm-up build metadata before any request was scheduled."""
    from vllm_shadowkv.backend.worker_state import WorkerState

    assert WorkerState().batch_requests(4) == ([], [])


def test_silent_when_no_method_runs_on_the_worker(tmp_path, monkeypatch):
    """Under another backend the runner hook still calls report() every step: nothing is
    logged and no stats file is written."""
    from unittest.mock import Mock

    from vllm_shadowkv.backend.worker_state import STATS_DIR_ENV, WorkerState

    monkeypatch.setenv(STATS_DIR_ENV, str(tmp_path))
    logger = Mock()
    WorkerState().report(logger)
    assert not logger.method_calls and not list(tmp_path.iterdir())


def test_snapshot_file_at_once_on_lifecycle_and_throttled_while_counters_grow(tmp_path,
                                                                             monkeypatch):
    """A request's start and finish are written at once; the counters of running requests,
    which grow every decode step, at most every WRITE_EVERY_S."""
    import json
    from unittest.mock import Mock

    from vllm_shadowkv.backend import worker_state
    from vllm_shadowkv.backend.worker_state import STATS_DIR_ENV, RequestStats, WorkerState

    monkeypatch.setenv(STATS_DIR_ENV, str(tmp_path))
    clock = [100.0]
    monkeypatch.setattr(worker_state.time, "monotonic", lambda: clock[0])
    state = WorkerState()
    state.engine = engine_facts(1 << 30)

    def written():
        (path,) = tmp_path.glob("worker-*.json")
        return json.loads(path.read_text())

    state.requests["a"] = RequestStats(mode="sparse", selected=10)
    state.report(Mock())
    assert written()["running_sparse"] == 1 and written()["selected"] == 10
    state.requests["a"].selected = 20  # a decode step later
    clock[0] += 0.1
    state.report(Mock())
    assert written()["selected"] == 10  # throttled
    clock[0] += worker_state.WRITE_EVERY_S
    state.report(Mock())
    assert written()["selected"] == 20
    state.requests["a"].selected = 30
    state.totals["selected"] += state.requests.pop("a").selected  # finished: at once
    state.totals["finished_sparse"] += 1
    clock[0] += 0.1
    state.report(Mock())
    assert written()["finished_sparse"] == 1 and written()["selected"] == 30


def test_a_stats_directory_that_cannot_be_written_never_fails_a_step(tmp_path, monkeypatch):
    """A Ray worker on another node gets the front end's directory path (created there only): it
    creates it; where it cannot be written at all, the metrics are off for the worker, said once."""
    from unittest.mock import Mock

    from vllm_shadowkv.backend.worker_state import STATS_DIR_ENV, RequestStats, WorkerState

    def worker():
        state = WorkerState()
        state.engine = engine_facts(1)
        state.requests["a"] = RequestStats(mode="sparse")
        return state

    missing = tmp_path / "not" / "here"
    monkeypatch.setenv(STATS_DIR_ENV, str(missing))
    worker().report(Mock())
    assert len(list(missing.glob("worker-*.json"))) == 1

    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(STATS_DIR_ENV, str(tmp_path / "a_file" / "stats"))
    state, logger = worker(), Mock()
    state.report(logger)
    state.requests["b"] = RequestStats()  # a lifecycle change: would be written at once
    state.report(logger)
    assert logger.warning.call_count == 1
    assert "cannot write this worker's metrics" in logger.warning.call_args[0][0]


def test_a_preempted_request_is_counted_once_with_all_its_traffic():
    """Preempted (its rows freed, recomputed later) is not finished: the stats wait for the
    request to run again and are counted when it finishes or is aborted."""

    from vllm_shadowkv.backend.worker_state import WorkerState

    state = WorkerState()
    state.engine = engine_facts(1 << 30, rank=1)
    state.request("a", 2048, sparse=True).selected = 10
    state.request("b", 2048, sparse=True).selected = 5
    state.release(ended=(), suspended=["a", "b"])
    snap = state.snapshot()
    assert (snap["running_sparse"], snap["finished_sparse"], snap["selected"]) == (0, 0, 15)
    state.release(ended=(), suspended=["a"])  # resumed: released again before it runs
    assert state.request("a", 2048, sparse=True).selected == 10  # taken back
    state.requests["a"].selected += 7
    state.release(ended=["a", "b"])  # a finishes; b is aborted while waiting
    snap = state.snapshot()
    assert (snap["running_sparse"], snap["finished_sparse"], snap["selected"]) == (0, 2, 22)
    assert snap["data_parallel_rank"] == 1
    assert {req_id: s.preemptions for req_id, s in state.finished} == {"a": 1, "b": 1}
    assert not state.requests and not state.suspended


def test_another_engine_in_the_process_starts_from_an_empty_state():
    """A second engine in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0) must not inherit the
    first's host store (sized by the first's settings), methods, requests or counters; the
    layers of one engine share its state."""

    import torch

    from vllm_shadowkv.backend.worker_state import RequestStats, WorkerState

    class Config:  # stands in for VllmConfig: the state keeps a weak reference to it
        pass

    class Method(SimpleNamespace):  # hashable, as the KVMethods in state.methods are
        __hash__ = object.__hash__

    state, first, second = WorkerState(), Config(), Config()
    state.begin_engine(engine_facts(1 << 20), first)
    state.store_for((2, 8), torch.float32)
    state.methods.add(Method(release=lambda req_id: None))
    state.requests["0"] = RequestStats(mode="sparse")
    state.release(["0"])
    state.begin_engine(engine_facts(1 << 20), first)  # the engine's next layer
    assert state._stores and state.methods and state.totals["finished_sparse"] == 1

    state.begin_engine(engine_facts(1 << 19), second)
    assert not state._stores and not state.methods and not state.totals
    assert not state.finished and state.runner_ref is None
    assert state.store_for((2, 8), torch.float32).capacity_bytes == 1 << 19
    assert state.engine.stamp.store_bytes == 1 << 19


def test_an_engine_of_another_backend_drops_the_plugins_state():
    """A runner whose config has no method stamp (another backend's engine after a plugin one,
    in one process) must not keep the earlier engine's store allocated or its counters
    reported; a plugin engine's runner keeps its state."""

    import torch

    from vllm_shadowkv.backend.worker_state import RequestStats, WorkerState
    from vllm_shadowkv.config import STAMP_KEY, Stamp
    from vllm_shadowkv.methods.shadowkv import ShadowKVSettings

    class Runner(SimpleNamespace):
        pass

    state = WorkerState()
    state.engine = engine_facts(1 << 20)
    state.store_for((2, 8), torch.float32)
    state.requests["0"] = RequestStats(mode="sparse")
    stamp = Stamp("shadowkv", ShadowKVSettings(), 1 << 20).to_json()
    ours = Runner(vllm_config=SimpleNamespace(additional_config={STAMP_KEY: stamp}))
    state.attach(ours)
    state.attach(ours)
    assert state._stores and state.requests and state.runner is ours

    other = Runner(vllm_config=SimpleNamespace(additional_config={}))
    state.attach(other)
    assert state.engine is None and not state._stores and not state.requests
    assert state.runner is other
