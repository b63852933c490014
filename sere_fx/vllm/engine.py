"""Where the plugin meets the engine: attaching to a loaded model, the per-step row masks, statistics.

- ``attach`` runs in every worker right after vLLM loaded the model (before it is compiled):
  it finds every MoE layer (``MoERunner``), validates the settings against them and installs
  a ``LayerRouting`` on each router.
- Continuous batching mixes prefill and decode tokens in one forward. Once per forward step
  (when vLLM creates its ``ForwardContext``) two persistent boolean buffers are refreshed from
  the attention metadata: *decode rows* (the token of a request whose query length is 1)
  and *real rows* (not padding). ``torch.ops.sere.engine_reroute`` (SERE's whole step: the
  op's rule on this step's rows) and ``torch.ops.sere.engine_rows`` (a copy of the first T
  entries, for the other policies) read them. Both are opaque ops, so Dynamo does not freeze
  the mask of the step it traced; the buffers are persistent and updated by device ops only,
  so a CUDA-graph replay sees the current step's rows.
- ``torch.ops.sere.record_routing`` (only when ``stats`` is set) adds per-layer counters on
  the device, without a host sync; ``worker_stats`` reads them for ``routing_stats``.
"""

from __future__ import annotations

import torch

from sere_fx.ops import primary_mask, reroute_kernel
from sere_fx.policies import TOPK_POLICIES
from sere_fx.vllm.routing import LayerRouting, RouterScores, install
from sere_fx.vllm.settings import WHERE, EngineLayer, SettingsError, parse, resolve_layers, to_device


def _logger():
    from vllm.logger import init_logger  # under "vllm." so that vLLM's log settings apply

    return init_logger("vllm.sere_fx")


# Statistic fields, summed on the device per layer: ``decode_steps`` counts calls with at least
# one re-routed row; the rest are sums over those calls (``prefill_rows``: real rows in them that
# kept the model's routing, i.e. mixed batches).
STAT_FIELDS = ("decode_steps", "decode_rows", "prefill_rows", "distinct_before", "distinct_after", "slots_rerouted",
               "critical_kept")


class _Engine:
    """Per-process state: the row buffers and the statistics of the attached layers."""

    def __init__(self):
        self.decode: torch.Tensor | None = None  # bool [max_tokens]
        self.real: torch.Tensor | None = None  # bool [max_tokens]
        self.positions: torch.Tensor | None = None  # int64 arange [max_tokens]
        self.stats: dict[int, torch.Tensor] = {}  # layer -> float64 [len(STAT_FIELDS)]
        self.layers: dict[int, LayerRouting] = {}

    def allocate(self, max_tokens: int, device) -> None:
        self.decode = torch.zeros(max_tokens, dtype=torch.bool, device=device)
        self.real = torch.zeros(max_tokens, dtype=torch.bool, device=device)
        self.positions = torch.arange(max_tokens, device=device)

    def refresh(self, attn_metadata) -> None:
        """New forward step: recompute both masks from ``query_start_loc`` (device ops only)."""
        if self.decode is None:
            return
        qsl = _query_start_loc(attn_metadata)
        self.decode.zero_()
        if qsl is None:  # no attention metadata (profiling and dummy runs): no decode rows
            self.real.fill_(True)
            return
        qsl = qsl.to(device=self.decode.device, dtype=torch.int64)
        starts, lengths = qsl[:-1], qsl[1:] - qsl[:-1]
        # A request with one query token is decoding; padded requests (length 0) start at or past
        # the last real token, so clamping their start into range writes False on padding rows.
        self.decode.scatter_(0, starts.clamp(max=self.decode.shape[0] - 1), lengths == 1)
        torch.lt(self.positions, qsl[-1], out=self.real)
        self.decode &= self.real


ENGINE = _Engine()


def _query_start_loc(attn_metadata):
    if isinstance(attn_metadata, dict):
        for meta in attn_metadata.values():
            qsl = getattr(meta, "query_start_loc", None)
            if isinstance(qsl, torch.Tensor):
                return qsl
    return None


# --- custom ops ------------------------------------------------------------------------------
# Registered with the low-level ``torch.library.Library`` API: on the CPU a Python custom op
# through ``custom_op`` costs ~10 us of wrapper code per call, this ~2 us, and these run in
# every MoE layer of every step.

_LIB = torch.library.Library("sere", "FRAGMENT")
_LIB.define("engine_rows(Tensor topk_ids, bool decode_only) -> Tensor")
_LIB.define("engine_reroute(Tensor topk_ids, Tensor similarity, int S, float rho, Tensor rank_values, "
            "bool decode_only) -> Tensor")
_LIB.define("record_routing(Tensor before, Tensor after, Tensor rank_values, Tensor rows, int layer, int S, int num_experts) -> Tensor")


def _rows(topk_ids: torch.Tensor, decode_only: bool) -> torch.Tensor:
    n = topk_ids.shape[0]
    source = ENGINE.decode if decode_only else ENGINE.real
    if source is None or n > source.shape[0]:
        # Outside an engine step (or a batch larger than the scheduler's token budget): no row is
        # re-routed, so the model routes as it would without the plugin.
        return torch.zeros(n, dtype=torch.bool, device=topk_ids.device)
    return source[:n]


def _engine_rows(topk_ids: torch.Tensor, decode_only: bool) -> torch.Tensor:
    return _rows(topk_ids, decode_only).clone()


def _engine_reroute(topk_ids, similarity, S: int, rho: float, rank_values, decode_only: bool) -> torch.Tensor:
    # sere.reroute's rule on this step's rows, in one opaque call: the NumPy kernel on the CPU,
    # the Triton kernel on CUDA (sere.reroute itself is inlined by compilers, see sere_fx.ops).
    return reroute_kernel(topk_ids, similarity, S, rho, rank_values, _rows(topk_ids, decode_only))


def _record_routing(before, after, rank_values, rows, layer: int, S: int, e: int) -> torch.Tensor:
    # Experts used by the rows = primary_mask over all K slots.
    k = before.shape[1]
    seen_before, seen_after = primary_mask(before, k, e, valid_rows=rows), primary_mask(after, k, e, valid_rows=rows)
    primary = primary_mask(before, S, e, rank_values, rows)
    n_rows = rows.sum()
    active = n_rows > 0
    real = ENGINE.real[: rows.shape[0]] if ENGINE.real is not None else torch.ones_like(rows)
    values = torch.stack([
        active.double(),
        n_rows.double(),
        ((real & ~rows).sum() * active).double(),
        seen_before.sum().double(),
        seen_after.sum().double(),
        ((before != after) & rows.unsqueeze(1)).sum().double(),
        (seen_after & ~primary).sum().double(),
    ])
    ENGINE.stats[layer].add_(values.to(ENGINE.stats[layer].device))
    return after.clone()


_LIB.impl("engine_rows", _engine_rows, "CompositeExplicitAutograd")
_LIB.impl("engine_reroute", _engine_reroute, "CompositeExplicitAutograd")
_LIB.impl("record_routing", _record_routing, "CompositeExplicitAutograd")


@torch.library.register_fake("sere::engine_rows", lib=_LIB)
def _(topk_ids, decode_only):
    return topk_ids.new_empty(topk_ids.shape[0], dtype=torch.bool)


@torch.library.register_fake("sere::engine_reroute", lib=_LIB)
def _(topk_ids, similarity, S, rho, rank_values, decode_only):
    return torch.empty_like(topk_ids)


@torch.library.register_fake("sere::record_routing", lib=_LIB)
def _(before, after, rank_values, rows, layer, S, num_experts):
    return torch.empty_like(after)


# --- attaching -------------------------------------------------------------------------------


def _moe_runners(model):
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface

    return [m for m in model.modules() if isinstance(m, MoERunnerInterface)]


def engine_layers(runners) -> list[EngineLayer]:
    """The engine's MoE layers (``MoERunner`` objects), refusing kernels that route internally."""
    from vllm.model_executor.models.utils import extract_layer_index

    layers = []
    for runner in runners:
        if runner.is_monolithic:
            raise SettingsError(
                f"{WHERE}: {runner.layer_name} runs a monolithic MoE kernel, which routes inside the kernel, so "
                "SERE cannot re-route it; select a modular MoE backend with moe_backend='triton' (--moe-backend triton)"
            )
        layers.append(EngineLayer(extract_layer_index(runner.layer_name), runner.layer_name,
                                  runner.moe_config.num_logical_experts, runner.router.top_k))
    return layers


def attach(model, vllm_config, raw) -> dict[int, LayerRouting]:
    """Install the routing of ``raw`` (``additional_config["sere"]``) on every MoE layer of ``model``."""
    settings = parse(raw)
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1:
        raise SettingsError(
            f"{WHERE}: data_parallel_size {parallel.data_parallel_size} is not supported (expected 1): data-parallel "
            "ranks route different batches; use tensor_parallel_size (with enable_expert_parallel) instead"
        )
    runners = _moe_runners(model)
    architecture = (getattr(vllm_config.model_config.hf_config, "architectures", None) or [None])[0]
    if not runners:
        raise SettingsError(f"{WHERE}: the served model ({architecture}) has no MoE layer to re-route")
    layers = engine_layers(runners)
    plans, matrices = resolve_layers(settings, layers, architecture)
    device = vllm_config.device_config.device
    matrices = to_device(matrices, device)
    ENGINE.allocate(vllm_config.scheduler_config.max_num_batched_tokens, device)
    installed = {}
    for runner, layer in zip(runners, layers):
        plan = plans[layer.index]
        scores = RouterScores.of(runner.router)
        if plan.policy in TOPK_POLICIES and scores.unsupported:
            raise SettingsError(
                f'{WHERE}["policy"]: {plan.policy!r} recomputes routing weights, but layer {layer.index} '
                f"({scores.router}) cannot be reproduced: {scores.unsupported}; use policy 'sere'"
            )
        if scores.bias is not None and scores.scoring_func is None:
            raise SettingsError(f"{WHERE}: layer {layer.index} ({scores.router}) ranks experts by a biased score "
                                f"sere-fx cannot recompute ({scores.unsupported})")
        if plan.S >= layer.top_k:
            continue  # S = K leaves this layer's routing as it is
        routing = LayerRouting(layer.index, plan, scores, matrices.get(layer.index), layer.num_experts,
                               settings.decode_only, settings.stats)
        install(runner.router, routing)
        installed[layer.index] = routing
        if settings.stats:
            ENGINE.stats[layer.index] = torch.zeros(len(STAT_FIELDS), dtype=torch.float64, device=device)
    ENGINE.layers = installed
    summary = ", ".join(f"{i}: {p.policy} S={p.S}" + (f" rho={p.rho:.3g}" if p.rho is not None else "")
                        + (f" N={p.N}" if p.N is not None else "") for i, p in sorted(plans.items()))
    _logger().info("sere-fx: re-routing %d of %d MoE layers (%s); decode_only=%s, stats=%s",
                len(installed), len(layers), summary, settings.decode_only, settings.stats)
    return installed


def worker_stats(worker=None) -> dict[int, dict[str, float]]:
    """This worker's counters as ``{layer: {field: sum}}`` (empty when stats are off)."""
    return {layer: dict(zip(STAT_FIELDS, acc.tolist())) for layer, acc in sorted(ENGINE.stats.items())}


def reset_worker_stats(worker=None) -> None:
    for acc in ENGINE.stats.values():
        acc.zero_()
