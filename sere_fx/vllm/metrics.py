"""The routing statistics on the OpenAI server's ``/metrics`` (Prometheus), with ``"stats": true``.

The counters live on each worker's device (``sere_fx.vllm.engine``); ``/metrics`` is served by
the API server process, which holds no model. So:

- in the calling process (the API server), ``prepare`` makes a fresh directory, names it in
  ``SERE_FX_METRICS_DIR`` (inherited by the engine and worker processes vLLM starts afterwards)
  and registers a collector with ``prometheus_client``'s default registry, the one vLLM's
  ``/metrics`` serves;
- in every worker, ``start_export`` starts a daemon thread that writes the worker's counters to
  ``<dir>/rank<R>.json`` once a second (atomically: write, then rename);
- each scrape reads the files. Tensor-parallel ranks hold the same layers and the same counts;
  pipeline stages hold different layers; the collector takes each layer from the first rank
  that has it.

vLLM's stat-logger plugins (``vllm.stat_logger_plugins``) run in the same API server process but
would turn vLLM's own stat logging on in every engine of the environment, with or without
sere-fx settings, so the collector is registered directly instead.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import threading
import time

from sere_fx.vllm.settings import RANGE_PREFIX

ENV_DIR = "SERE_FX_METRICS_DIR"
_INTERVAL_S = 1.0

# (name, statistic field, help); counters are sums over the engine's decode steps
_COUNTERS = (
    ("sere_fx_decode_steps", "decode_steps", "MoE layer calls with at least one re-routed row"),
    ("sere_fx_rows_rerouted", "decode_rows", "rows re-routed (decode rows, speculative verification rows)"),
    ("sere_fx_rows_kept", "prefill_rows", "real rows on the model's routing in those calls (prompt rows, opted out)"),
    ("sere_fx_distinct_experts_before", "distinct_before", "distinct experts the re-routed rows picked, summed over steps"),
    ("sere_fx_distinct_experts_after", "distinct_after", "distinct experts the re-routed rows read, summed over steps"),
    ("sere_fx_slots_rerouted", "slots_rerouted", "top-k slots whose expert changed"),
    ("sere_fx_critical_kept", "critical_kept", "non-primary experts kept, summed over steps"),
    ("sere_fx_distinct_experts_free", "free_after",
     "distinct experts the re-routed rows read that kept rows read anyway, summed over steps"),
    ("sere_fx_token_slots_before", "slots_before", "token-slots of the re-routed rows without sere-fx (K per row)"),
    ("sere_fx_token_slots_after", "slots_after",
     "token-slots of the re-routed rows the MoE kernel computes (merged slots count once)"),
)

_COLLECTOR = None


def _model_name(vllm_config) -> str:
    config = vllm_config.model_config
    served = getattr(config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served or config.model)


def prepare(vllm_config) -> None:
    """In the calling process: the directory the workers write to, and the collector that reads it."""
    global _COLLECTOR
    directory = os.environ.get(ENV_DIR)
    if not directory or not os.path.isdir(directory):
        directory = tempfile.mkdtemp(prefix="sere-fx-metrics-")
        os.environ[ENV_DIR] = directory
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from sere_fx.vllm.log import logger as _logger

        _logger().warning("sere-fx: /metrics is served from several API server processes here "
                          "(PROMETHEUS_MULTIPROC_DIR is set), which do not show sere-fx's statistics; read them "
                          "with sere_fx.vllm.routing_stats or serve with one API server process")
        return
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # vLLM requires prometheus_client; an offline engine without it has no /metrics
        return
    if _COLLECTOR is None:
        _COLLECTOR = Collector()
        REGISTRY.register(_COLLECTOR)
    _COLLECTOR.directory = directory


def read_exports(directory: str) -> dict[str, dict[int, dict[str, float]]]:
    """``{model: {layer: {field: sum}}}`` from the workers' files (first rank wins per layer)."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank*.json")), key=_rank_of):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):  # a worker that is being replaced: next scrape
            continue
        layers = out.setdefault(data["model"], {})
        for layer, sums in data["layers"].items():
            layers.setdefault(int(layer), sums)
    return out


def _rank_of(path: str) -> int:
    name = os.path.basename(path)[len("rank"):-len(".json")]
    return int(name) if name.isdigit() else 1 << 30


class Collector:
    """A ``prometheus_client`` collector over the workers' exports."""

    directory: str | None = None

    def describe(self):
        return []  # dynamic: no fixed set of series to check at registration

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        exports = read_exports(self.directory) if self.directory else {}
        labels = ["model_name", "layer"]
        families = [CounterMetricFamily(name, text, labels=labels) for name, _, text in _COUNTERS]
        means = {side: GaugeMetricFamily(f"sere_fx_distinct_experts_{side}_per_step",
                                         f"distinct experts {side} re-routing, mean per decode step", labels=labels)
                 for side in ("before", "after")}
        ranges = CounterMetricFamily("sere_fx_range_steps", "decode steps whose re-routed row count fell in the plan's "
                                     "range from min_rows (plans that follow the load)",
                                     labels=labels + ["min_rows"])
        for model, layers in sorted(exports.items()):
            for layer, sums in sorted(layers.items()):
                key = [model, str(layer)]
                for name, value in sums.items():
                    if name.startswith(RANGE_PREFIX):
                        ranges.add_metric(key + [name[len(RANGE_PREFIX):]], float(value))
                for family, (_, field, _) in zip(families, _COUNTERS):
                    family.add_metric(key, float(sums.get(field, 0.0)))
                steps = float(sums.get("decode_steps", 0.0))
                for side, family in means.items():
                    family.add_metric(key, float(sums.get(f"distinct_{side}", 0.0)) / steps if steps else 0.0)
        yield from families
        yield from means.values()
        yield ranges


def start_export(vllm_config, rank: int) -> None:
    """In a worker: write this worker's counters for the collector, once a second, until exit."""
    from sere_fx.vllm import engine

    directory = os.environ.get(ENV_DIR)
    if not engine.ENGINE.stats or not directory or not os.path.isdir(directory):
        return
    path = os.path.join(directory, f"rank{int(rank)}.json")
    model = _model_name(vllm_config)

    def export_forever():
        last = None
        while True:
            data = {"model": model, "layers": {str(k): v for k, v in engine.worker_stats().items()}}
            if data != last:
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(data, f)
                os.replace(tmp, path)
                last = data
            time.sleep(_INTERVAL_S)

    threading.Thread(target=export_forever, name="sere-fx-metrics", daemon=True).start()
