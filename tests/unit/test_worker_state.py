"""Per-worker engine state without an engine."""


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
