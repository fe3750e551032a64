import json

from vllm_shadowkv.metrics import EngineCollector


def test_collector_counts_requests_once_across_tensor_parallel_ranks(tmp_path):
    ranks = [{"method": "shadowkv", "running_sparse": 2, "running_dense": 1,
              "finished_sparse": 5, "finished_dense": 3, "selected": 100, "hits": 40,
              "bytes_fetched": 1000, "store_used_bytes": 4096, "store_capacity_bytes": 8192}, None]
    ranks[1] = {**ranks[0], "selected": 60, "hits": 30, "bytes_fetched": 500}
    for i, snap in enumerate(ranks):
        (tmp_path / f"worker-{i}.json").write_text(json.dumps(snap))
    (tmp_path / "worker-9.json").write_text("{")  # a worker mid-replace: skipped
    metrics = {m.name: {tuple(s.labels.values()): s.value for s in m.samples}
               for m in EngineCollector(str(tmp_path)).collect()}
    assert metrics["kv_compression_requests_running"] == {
        ("shadowkv", "sparse"): 2, ("shadowkv", "dense"): 1}
    assert metrics["kv_compression_requests_finished"][("shadowkv", "sparse")] == 5
    assert metrics["kv_compression_selected_rows"][("shadowkv",)] == 160
    assert metrics["kv_compression_hit_rows"][("shadowkv",)] == 70
    assert metrics["kv_compression_host_bytes_fetched"][("shadowkv",)] == 1500
    assert metrics["kv_compression_host_store_used_bytes"][("shadowkv",)] == 8192
    assert metrics["kv_compression_host_store_capacity_bytes"][("shadowkv",)] == 16384


def test_no_series_without_a_method_running(tmp_path):
    metrics = {m.name: list(m.samples) for m in EngineCollector(str(tmp_path)).collect()}
    assert all(samples == [] for samples in metrics.values())



def test_collector_adds_up_data_parallel_engines(tmp_path):
    """Each data-parallel engine runs its own requests: two engines of two TP ranks each."""
    base = {"method": "shadowkv", "running_sparse": 1, "running_dense": 0, "finished_sparse": 3,
            "finished_dense": 2, "selected": 10, "hits": 4, "bytes_fetched": 100,
            "store_used_bytes": 0, "store_capacity_bytes": 8192}
    snaps = [base | {"data_parallel_rank": 0}, base | {"data_parallel_rank": 0},
             base | {"data_parallel_rank": 1, "finished_sparse": 4},
             base | {"data_parallel_rank": 1, "finished_sparse": 4}]
    for i, snap in enumerate(snaps):
        (tmp_path / f"worker-{i}.json").write_text(json.dumps(snap))
    metrics = {m.name: {tuple(s.labels.values()): s.value for s in m.samples}
               for m in EngineCollector(str(tmp_path)).collect()}
    assert metrics["kv_compression_requests_running"][("shadowkv", "sparse")] == 2
    assert metrics["kv_compression_requests_finished"][("shadowkv", "sparse")] == 7
    assert metrics["kv_compression_requests_finished"][("shadowkv", "dense")] == 4
    assert metrics["kv_compression_selected_rows"][("shadowkv",)] == 40
    assert metrics["kv_compression_host_store_capacity_bytes"][("shadowkv",)] == 4 * 8192
