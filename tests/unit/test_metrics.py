import json

from vllm_shadowkv.metrics import ShadowKVCollector


def test_collector_counts_requests_once_across_tensor_parallel_ranks(tmp_path):
    ranks = [{"running_sparse": 2, "running_dense": 1, "finished_sparse": 5, "finished_dense": 3,
              "selected": 100, "hits": 40, "bytes_fetched": 1000,
              "store_used_bytes": 4096, "store_capacity_bytes": 8192}, None]
    ranks[1] = {**ranks[0], "selected": 60, "hits": 30, "bytes_fetched": 500}
    for i, snap in enumerate(ranks):
        (tmp_path / f"worker-{i}.json").write_text(json.dumps(snap))
    (tmp_path / "worker-9.json").write_text("{")  # a worker mid-replace: skipped
    metrics = {m.name: {tuple(s.labels.values()): s.value for s in m.samples}
               for m in ShadowKVCollector(str(tmp_path)).collect()}
    assert metrics["shadowkv_requests_running"] == {("sparse",): 2, ("dense",): 1}
    assert metrics["shadowkv_requests_finished"][("sparse",)] == 5
    assert metrics["shadowkv_selected_chunks"][()] == 160
    assert metrics["shadowkv_hit_chunks"][()] == 70
    assert metrics["shadowkv_value_bytes_fetched"][()] == 1500
    assert metrics["shadowkv_value_store_used_bytes"][()] == 8192
    assert metrics["shadowkv_value_store_capacity_bytes"][()] == 16384
