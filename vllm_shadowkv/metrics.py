"""Prometheus metrics of the shadowkv backend on vLLM's server ``/metrics``.

Workers write a snapshot of their counters every second (``WorkerState.report``) into a
directory the plugin creates in the front-end process and names in ``SHADOWKV_STATS_DIR`` (spawned
engine processes inherit it). A collector in the server process sums the workers' snapshots when
``/metrics`` is scraped.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile

from vllm_shadowkv.backend.worker_state import STATS_DIR_ENV

_COUNTERS = {
    "selected": ("shadowkv_selected_chunks", "Chunk slots selected by sparse decode (all heads)"),
    "hits": ("shadowkv_hit_chunks", "Selected chunk slots already resident (hit cache)"),
    "bytes_fetched": ("shadowkv_value_bytes_fetched", "Value bytes moved from the value store"),
}
_GAUGES = {
    "store_used_bytes": ("shadowkv_value_store_used_bytes", "Value store bytes in use"),
    "store_capacity_bytes": ("shadowkv_value_store_capacity_bytes", "Value store capacity"),
}


def ensure_stats_dir() -> str:
    path = os.environ.get(STATS_DIR_ENV)
    if not path:
        path = os.environ[STATS_DIR_ENV] = tempfile.mkdtemp(prefix="shadowkv-stats-")
    return path


class ShadowKVCollector:
    def __init__(self, stats_dir: str):
        self.stats_dir = stats_dir

    def _totals(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for path in glob.glob(os.path.join(self.stats_dir, "worker-*.json")):
            try:
                with open(path) as f:
                    snap = json.load(f)
            except (OSError, ValueError):
                continue  # a worker replacing its file right now
            for key, value in snap.items():
                # Every tensor-parallel rank runs every request (on its own KV heads): request
                # counts are the same on all ranks, traffic and store bytes add up.
                combine = max if key.startswith(("running_", "finished_")) else sum
                totals[key] = combine((totals.get(key, 0), value))
        return totals

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        totals = self._totals()
        running = GaugeMetricFamily("shadowkv_requests_running", "Running requests by mode",
                                    labels=["mode"])
        finished = CounterMetricFamily("shadowkv_requests_finished",
                                       "Finished requests by mode", labels=["mode"])
        for mode in ("sparse", "dense"):
            running.add_metric([mode], totals.get(f"running_{mode}", 0))
            finished.add_metric([mode], totals.get(f"finished_{mode}", 0))
        yield running
        yield finished
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=totals.get(key, 0))
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=totals.get(key, 0))


_REGISTERED: list[ShadowKVCollector] = []


def register_collector() -> None:
    """In the front-end process, once: export the workers' stats with vLLM's own metrics."""
    if _REGISTERED:
        return
    from prometheus_client import REGISTRY

    collector = ShadowKVCollector(ensure_stats_dir())
    REGISTRY.register(collector)
    _REGISTERED.append(collector)
