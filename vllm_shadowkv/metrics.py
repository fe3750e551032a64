"""Prometheus metrics of the engine on vLLM's server ``/metrics``, labelled with the method.

Workers write a snapshot of their counters when they change, at most once per engine step
(``WorkerState.report``), into a directory the plugin creates in the front-end process and
names in ``SHADOWKV_STATS_DIR`` (engine processes inherit it; vLLM's Ray executor copies it to
its workers, on the same node). A collector in the server process sums the snapshots when
``/metrics`` is scraped.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile

from vllm_shadowkv.backend.worker_state import STATS_DIR_ENV

PREFIX = "kv_compression"
_COUNTERS = {
    "selected": ("selected_rows", "Host-store rows selected by compressed decode (all heads)"),
    "hits": ("hit_rows", "Selected rows already resident from the previous step (hit cache)"),
    "bytes_fetched": ("host_bytes_fetched", "Bytes moved from the host store"),
}
_GAUGES = {
    "store_used_bytes": ("host_store_used_bytes", "Host store bytes in use"),
    "store_capacity_bytes": ("host_store_capacity_bytes", "Host store capacity"),
}


RAY_COPY_ENV = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"  # vLLM's list of extra variables for Ray


def ensure_stats_dir() -> str:
    path = os.environ.get(STATS_DIR_ENV)
    if not path:
        path = os.environ[STATS_DIR_ENV] = tempfile.mkdtemp(prefix="shadowkv-stats-")
    # Ray workers get only the variables vLLM copies: name ours among them.
    copied = [name for name in os.environ.get(RAY_COPY_ENV, "").split(",") if name]
    if STATS_DIR_ENV not in copied:
        os.environ[RAY_COPY_ENV] = ",".join([*copied, STATS_DIR_ENV])
    return path


class EngineCollector:
    def __init__(self, stats_dir: str):
        self.stats_dir = stats_dir

    def _totals(self) -> dict[str, dict[str, float]]:
        """Per method, the workers' counters combined. Every tensor-parallel rank of an engine
        runs every request of that engine (on its own KV heads): request counts are taken once
        per engine (data-parallel rank) and added over engines; traffic and store bytes add up
        over all workers."""
        engines: dict[tuple[str, int], dict[str, float]] = {}
        for path in glob.glob(os.path.join(self.stats_dir, "worker-*.json")):
            try:
                with open(path) as f:
                    snap = json.load(f)
            except (OSError, ValueError):
                continue  # a worker replacing its file right now
            engine = engines.setdefault(
                (snap.pop("method", "unknown"), snap.pop("data_parallel_rank", 0)), {})
            for key, value in snap.items():
                combine = max if key.startswith(("running_", "finished_")) else sum
                engine[key] = combine((engine.get(key, 0), value))
        totals: dict[str, dict[str, float]] = {}
        for (method, _), values in engines.items():
            combined = totals.setdefault(method, {})
            for key, value in values.items():
                combined[key] = combined.get(key, 0) + value
        return totals

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        totals = self._totals()
        running = GaugeMetricFamily(f"{PREFIX}_requests_running",
                                    "Running requests by method and mode (sparse: compressed)",
                                    labels=["method", "mode"])
        finished = CounterMetricFamily(f"{PREFIX}_requests_finished",
                                       "Finished requests by method and mode",
                                       labels=["method", "mode"])
        counters = {key: CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["method"])
                    for key, (name, doc) in _COUNTERS.items()}
        gauges = {key: GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["method"])
                  for key, (name, doc) in _GAUGES.items()}
        for method, values in totals.items():
            for mode in ("sparse", "dense"):
                running.add_metric([method, mode], values.get(f"running_{mode}", 0))
                finished.add_metric([method, mode], values.get(f"finished_{mode}", 0))
            for key, family in (counters | gauges).items():
                family.add_metric([method], values.get(key, 0))
        yield running
        yield finished
        yield from counters.values()
        yield from gauges.values()


_REGISTERED: list[EngineCollector] = []


def register_collector() -> None:
    """In the front-end process, once: export the workers' stats with vLLM's own metrics."""
    if _REGISTERED:
        return
    from prometheus_client import REGISTRY

    collector = EngineCollector(ensure_stats_dir())
    REGISTRY.register(collector)
    _REGISTERED.append(collector)
