"""Where the plugin meets the engine: attaching to the served model, the per-step row masks, statistics.

- ``attach`` runs in every worker right after the worker loaded its model (before it is
  compiled), on the model runner's own model only: a speculative-decoding draft model is
  loaded by the runner too but never attached. It finds every MoE layer (``MoERunner``),
  validates the settings against them and installs a ``LayerRouting`` on each router.
- A row is a *decode row* when its request has computed all its prompt tokens (vLLM's own
  notion of "not prefilling"), whatever its number of query tokens: a prefix-cache suffix or
  a 1-token prompt chunk is prompt processing, and all 1+k rows of a speculative verification
  are decode rows. Each step the model runner hands ``plan_step`` the batch's requests (in row
  order), which of them are prefilling, the scheduled draft tokens and its device
  ``query_start_loc``; when the step's ``ForwardContext`` is created, persistent device
  buffers are filled from them with device ops: *re-routed rows* (decode rows of requests
  that did not opt out; every real row with ``decode_only: false``) and *kept rows* (the other
  real rows, whose experts are read anyway and so are free for the re-routed ones). A forward
  with no planned step (profiling, CUDA-graph capture, a draft model's pass) has neither.
- ``torch.ops.sere.engine_reroute`` (SERE's whole step: the op's rule on this step's rows) and
  ``torch.ops.sere.engine_rows`` (the re-routed rows and the experts the kept rows read, for
  the other policies) read them. On the CPU their native twins in ``torch.ops.sere_native``
  (``kernels/engine_op.cpp``), whose buffers ``allocate`` binds, replace them.
  Both are opaque ops, so Dynamo does not freeze the masks of the step it traced; the buffers
  are persistent and updated by device ops only, so a CUDA-graph replay sees the current step.
- ``sere_fx.vllm.slots`` makes vLLM's CPU fused-MoE kernel compute each token's distinct experts
  once (``merge_slots``, on by default).
- ``torch.ops.sere.record_routing`` (only when ``stats`` is set) adds per-layer counters on
  the device, without a host sync; ``worker_stats`` reads them for ``routing_stats`` and the
  server's ``/metrics`` (``sere_fx.vllm.metrics``).
"""

from __future__ import annotations

import numpy as np
import torch

from sere_fx.kernels import reroute_cpu
from sere_fx.ops import free_experts, primary_mask, reroute_kernel
from sere_fx.placement import Placement
from sere_fx.config import OffConfig, RowRanges, is_exact, range_index
from sere_fx.policies import TOPK_POLICIES
from sere_fx.stats import repeated_slots
from sere_fx.vllm import slots
from sere_fx.vllm.log import logger as _logger
from sere_fx.vllm.routing import LayerRouting, RangeRouting, RouterScores, install, predictor_refusal, uninstall
from sere_fx.vllm.settings import (RANGE_PREFIX, REQUEST_KEY, WHERE, EngineLayer, SettingsError, parse, request_reroutes, resolve_layers,
                                   to_device)


# Statistic fields, summed on the device per layer: ``decode_steps`` counts calls with at least
# one re-routed row; the rest are sums over those calls (``prefill_rows``: real rows in them that
# kept the model's routing: prompt rows of mixed batches, opted-out requests).
# ``free_after``: distinct experts the re-routed rows read that kept rows read anyway.
# ``slots_before`` / ``slots_after``: token-slots of the re-routed rows that the MoE kernel computes
# without the plugin (K each) and with it (each row's distinct experts where the layer's kernel
# merges slots in that step, ``sere_fx.vllm.slots``; K each where it does not).
STAT_FIELDS = ("decode_steps", "decode_rows", "prefill_rows", "distinct_before", "distinct_after", "slots_rerouted",
               "critical_kept", "free_after", "slots_before", "slots_after")
# With an expert-parallel placement (``ep_ranks``, or the engine's own EP): per call, the busiest
# rank's distinct experts before / after and token-slots after, summed like the fields above.
EP_STAT_FIELDS = ("max_rank_before", "max_rank_after", "max_rank_slots_after")


class _Engine:
    """Per-process state: the row buffers, the planned step and the statistics of the attached layers."""

    def __init__(self):
        self.rows: torch.Tensor | None = None  # bool [max_tokens]: re-routed rows
        self.kept: torch.Tensor | None = None  # bool [max_tokens]: real rows on the model's routing
        self.positions: torch.Tensor | None = None  # int32 arange [max_tokens]
        self.request_flags: torch.Tensor | None = None  # bool [max_reqs + 1]: re-routed requests
        self.stats: dict[int, torch.Tensor] = {}  # layer -> float64 [len(STAT_FIELDS)]
        self.rank_stats: dict[int, torch.Tensor] = {}  # layer -> float64 [len(EP_STAT_FIELDS)], with a placement
        self.owner: dict[int, torch.Tensor] = {}  # layer -> each expert's EP rank, with a placement
        self.ep_ranks = 0
        self.layers: dict[int, LayerRouting] = {}
        self.merging: set[int] = set()  # layers whose MoE kernel merges slots (sere_fx.vllm.slots)
        self.decode_only = True
        self.spec_decode = "reroute"
        self.opted_out: set[str] = set()
        self.pending = None  # (flags: np.bool_ [n], query_start_loc [n + 1]) of the next forward
        self.any_kept = False  # host copy of kept.any(), for the CPU ops' pure-decode fast path
        self.native = False  # the row buffers are bound to the torch.ops.sere_native ops
        # plans that follow the load: the ranges' lower bounds (None: one setting for every step), this
        # step's re-routed row count and range, and per layer the steps each range took (with stats)
        self.bounds: tuple[int, ...] | None = None
        self.step_rows = 0
        self.range = 0
        self.range_steps: dict[int, list[int]] = {}
        # ranges that are off on every re-routed layer: no op of such a step reads the row masks
        self.off_ranges: frozenset[int] = frozenset()
        self._warned: set[str] = set()

    def allocate(self, max_tokens: int, max_requests: int, device) -> None:
        self.rows = torch.zeros(max_tokens, dtype=torch.bool, device=device)
        self.kept = torch.zeros(max_tokens, dtype=torch.bool, device=device)
        self.positions = torch.arange(max_tokens, dtype=torch.int32, device=device)
        self.request_flags = torch.zeros(max_requests + 1, dtype=torch.bool, device=device)
        self.pending = None
        self.opted_out = set()
        # The native CPU op reads these buffers itself (bound once; refresh updates them in place).
        self.native = self.rows.device.type == "cpu" and reroute_cpu.load_engine_op()
        # On the CPU the masks are filled through numpy views of the same memory: a few
        # microseconds a step against ~60 for the device ops over the whole buffer
        # (bench/vllm_refresh.py); ``filled`` is how many rows the last step set.
        self._host = (self.rows.numpy(), self.kept.numpy()) if self.rows.device.type == "cpu" else None
        self._filled = max_tokens
        if self.native:
            torch.ops.sere_native.engine_bind_rows(self.rows, self.kept)

    def plan_step(self, scheduler_output, req_ids, prefilling: np.ndarray, query_start_loc: torch.Tensor) -> None:
        """This step's requests, in row order: which are re-routed (host work on the runner's
        own arrays; nothing waits for the device)."""
        if self.rows is None:
            return
        for req in scheduler_output.scheduled_new_reqs:
            if self._opts_out(req.req_id, req.sampling_params):
                self.opted_out.add(req.req_id)
        if scheduler_output.finished_req_ids and self.opted_out:
            self.opted_out -= scheduler_output.finished_req_ids
        n = len(req_ids)
        flags = np.ones(n, dtype=bool) if not self.decode_only else ~np.asarray(prefilling[:n], dtype=bool)
        if self.opted_out:
            flags &= np.fromiter((r not in self.opted_out for r in req_ids), dtype=bool, count=n)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if self.spec_decode == "keep" and drafts:
            flags &= np.fromiter((not drafts.get(r) for r in req_ids), dtype=bool, count=n)
        self.pending = (flags, query_start_loc[: n + 1], self._rows(scheduler_output, req_ids, flags, query_start_loc))

    def _rows(self, scheduler_output, req_ids, flags, query_start_loc) -> int:
        """The step's re-routed row count, on the host (only for plans that follow the load): the
        scheduler's token counts of the re-routed requests (the runner's query lengths without them)."""
        if self.bounds is None or not flags.any():
            return 0
        counts = getattr(scheduler_output, "num_scheduled_tokens", None)
        if counts:
            return int(sum(counts.get(r, 0) for r, f in zip(req_ids, flags) if f))
        q = query_start_loc[: flags.shape[0] + 1].cpu().numpy()
        return int(np.diff(q)[flags].sum())

    def _opts_out(self, req_id: str, params) -> bool:
        try:
            return not request_reroutes(getattr(params, "extra_args", None))
        except SettingsError as exc:
            # The calling process refuses such requests (sere_fx.vllm.register); one that got here
            # another way is re-routed, and each distinct value is said once.
            value = (params.extra_args or {}).get(REQUEST_KEY)
            self.warn_once(f"request-value:{value!r}", "sere-fx: request %s: %s; its rows are re-routed as by default",
                           req_id, exc)
            return False

    def refresh(self) -> None:
        """A forward starts: fill the row masks from the planned step, or clear them (device ops only)."""
        if self.rows is None:
            return
        pending, self.pending = self.pending, None
        if pending is None:  # profiling, CUDA-graph capture, a draft model's forward
            self.rows.zero_()
            self.kept.zero_()
            self._filled = 0
            self.any_kept = False
            self.step_rows = self.range = 0
            return
        flags, qsl, self.step_rows = pending
        if self.bounds is not None:
            self.range = range_index(self.bounds, self.step_rows)
            if self.step_rows:  # steps per range, for every ranged layer (with stats); not in the graph,
                for counts in self.range_steps.values():  # which may not reach the range op (RangeRouting)
                    counts[self.range] += 1
            if self.range in self.off_ranges:
                # Every layer runs its off branch, which reads no mask, so the masks are left as the
                # last step set them.
                # The one other reader, the merging kernel, runs vLLM's call on the model's own ids
                # whatever the masks say (nothing to merge), so its output is unchanged too.
                return
        n = flags.shape[0]
        self.any_kept = not flags.all()  # every scheduled request has rows: one left out keeps rows
        if self._host is not None and qsl.device.type == "cpu":
            self._fill_on_host(flags, qsl.numpy())
            return
        host = torch.from_numpy(flags)
        if self.request_flags.is_cuda:
            host = host.pin_memory()
        self.request_flags[:n].copy_(host, non_blocking=True)
        self.request_flags[n] = False  # rows past the last request (padding) map here
        qsl = qsl.to(device=self.positions.device, dtype=torch.int32)
        # each row's request: the number of requests that end at or before it
        request = torch.searchsorted(qsl[1:], self.positions, right=True).clamp_(max=n)
        torch.index_select(self.request_flags, 0, request, out=self.rows)
        torch.lt(self.positions, qsl[-1], out=self.kept)  # real rows
        self.rows &= self.kept
        self.kept &= ~self.rows

    def _fill_on_host(self, flags: np.ndarray, qsl: np.ndarray) -> None:
        """The device ops' masks, on the host: request i's rows are ``qsl[i]:qsl[i + 1]`` (the first
        request's from row 0), re-routed where ``flags[i]``; real rows that are not re-routed are
        kept; rows past ``qsl[-1]`` (padding, and what the last step set beyond it) are neither."""
        rows, kept = self._host
        real = min(int(qsl[-1]), rows.shape[0])
        if flags.shape[0]:
            lengths = np.diff(qsl)
            lengths[0] = qsl[1]
            rows[:real] = np.repeat(flags, lengths)[:real]
        kept[:real] = ~rows[:real]
        rows[real:self._filled] = False
        kept[real:self._filled] = False
        self._filled = real

    def warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _logger().warning(message, *args)


ENGINE = _Engine()


# --- custom ops ------------------------------------------------------------------------------
# Registered with the low-level ``torch.library.Library`` API: on the CPU a Python custom op
# through ``custom_op`` costs ~10 us of wrapper code per call, this ~2 us, and these run in
# every MoE layer of every step.

_LIB = torch.library.Library("sere", "FRAGMENT")
_LIB.define("engine_rows(Tensor topk_ids, int num_experts) -> (Tensor, Tensor)")
_LIB.define("engine_reroute(Tensor topk_ids, Tensor similarity, int S, float rho, Tensor rank_values) -> Tensor")
_LIB.define("engine_range(Tensor topk_ids) -> Tensor")
_LIB.define("record_routing(Tensor before, Tensor after, Tensor rank_values, Tensor rows, int layer, int S, int num_experts) -> Tensor")


def _mask(buffer: torch.Tensor | None, topk_ids: torch.Tensor) -> torch.Tensor:
    """This step's ``buffer`` (``ENGINE.rows`` or ``ENGINE.kept``) for a call of ``topk_ids``' rows."""
    n = topk_ids.shape[0]
    if buffer is None or n > buffer.shape[0]:
        # Outside an engine step (or a batch larger than the scheduler's token budget): no row is
        # re-routed, so the model routes as it would without the plugin.
        return torch.zeros(n, dtype=torch.bool, device=topk_ids.device)
    return buffer[:n]


def _no_kept_rows(topk_ids: torch.Tensor) -> bool:
    """A pure decode step, told by the host copy. Only on the CPU: a CUDA graph would freeze the
    branch taken at capture, so on CUDA the kept rows always go to the device."""
    return topk_ids.device.type == "cpu" and not ENGINE.any_kept


def _free(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Bool ``[E]``: the experts the kept rows read anyway."""
    if _no_kept_rows(topk_ids):
        return torch.zeros(num_experts, dtype=torch.bool)
    return free_experts(topk_ids, num_experts, _mask(ENGINE.kept, topk_ids))


def _engine_rows(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    # the re-routed rows, and the experts the kept rows read anyway (for the top-k policies)
    return _mask(ENGINE.rows, topk_ids).clone(), _free(topk_ids, num_experts)


def _engine_reroute(topk_ids, similarity, S: int, rho: float, rank_values) -> torch.Tensor:
    # sere.reroute's rule on this step's rows, in one opaque call: the C kernel on the CPU, the
    # Triton kernel on CUDA (sere.reroute itself is inlined by compilers, see sere_fx.ops).
    # Kept rows' experts are read anyway: they join the primary set.
    kept = None if _no_kept_rows(topk_ids) else ENGINE.kept
    rows = ENGINE.rows
    if (rows is not None and topk_ids.shape[0] <= rows.shape[0] and topk_ids.device.type == "cpu"
            and S < topk_ids.shape[1] and reroute_cpu.fits(similarity.shape[0], topk_ids.shape[1])
            and topk_ids.is_contiguous() and rank_values.dtype == torch.float32 and rank_values.is_contiguous()):
        # The hot path on the CPU: the kernel reads the first T entries of the persistent row
        # buffers themselves (no slices: each costs ~1 us, as much as the kernel).
        return reroute_cpu.launch(topk_ids, similarity, S, rho, rank_values, rows, kept)
    return reroute_kernel(topk_ids, similarity, S, rho, rank_values, _mask(rows, topk_ids),
                          None if kept is None else _mask(kept, topk_ids))


def _record_routing(before, after, rank_values, rows, layer: int, S: int, e: int) -> torch.Tensor:
    # Experts used by the rows = primary_mask over all K slots.
    k = before.shape[1]
    seen_before, seen_after = primary_mask(before, k, e, valid_rows=rows), primary_mask(after, k, e, valid_rows=rows)
    kept = _mask(ENGINE.kept, before)
    free = _free(before, e)
    primary = primary_mask(before, S, e, rank_values, rows) | free  # free experts count as primary
    n_rows = rows.sum()
    active = n_rows > 0
    slots_before = n_rows * k
    if layer in ENGINE.merging and _no_kept_rows(before):  # the kernel computes each row's distinct experts
        slots_after = (~repeated_slots(after) & rows.unsqueeze(1)).sum()
    else:
        slots_after = slots_before
    values = torch.stack([
        active.double(),
        n_rows.double(),
        (kept.sum() * active).double(),
        seen_before.sum().double(),
        seen_after.sum().double(),
        ((before != after) & rows.unsqueeze(1)).sum().double(),
        (seen_after & ~primary).sum().double(),
        (seen_after & free).sum().double(),
        slots_before.double(),
        slots_after.double(),
    ])
    ENGINE.stats[layer].add_(values.to(ENGINE.stats[layer].device))
    if layer in ENGINE.rank_stats:  # the busiest expert-parallel rank, on the device (no host sync)
        owner, ranks = ENGINE.owner[layer], ENGINE.ep_ranks
        per_rank = lambda mask: torch.zeros(ranks, dtype=torch.float64, device=owner.device).index_add_(  # noqa: E731
            0, owner, mask.double())
        ids = after.long().clamp(0, e - 1)
        counted = rows.unsqueeze(1) & (after >= 0) & (after < e)
        rank_slots = torch.zeros(ranks, dtype=torch.float64, device=owner.device).index_add_(
            0, owner[ids].flatten(), counted.flatten().double())
        ranked = torch.stack([per_rank(seen_before).max(), per_rank(seen_after).max(), rank_slots.max()]) * active
        ENGINE.rank_stats[layer].add_(ranked.to(ENGINE.rank_stats[layer].device))
    return after.clone()


def _engine_range(topk_ids) -> torch.Tensor:
    # A layer whose settings follow the load (routing.RangeRouting): this step's range, as the
    # int64 scalar its torch.cond chain branches on. scalar_tensor: ~1 us, torch.tensor ~2.6 us
    # (it parses a Python sequence). (Steps per range are counted once per step, in refresh.)
    return torch.scalar_tensor(ENGINE.range, dtype=torch.int64)


_LIB.impl("engine_rows", _engine_rows, "CompositeExplicitAutograd")
_LIB.impl("engine_range", _engine_range, "CompositeExplicitAutograd")
_LIB.impl("engine_reroute", _engine_reroute, "CompositeExplicitAutograd")
_LIB.impl("record_routing", _record_routing, "CompositeExplicitAutograd")


@torch.library.register_fake("sere::engine_rows", lib=_LIB)
def _(topk_ids, num_experts):
    return (topk_ids.new_empty(topk_ids.shape[0], dtype=torch.bool),
            topk_ids.new_empty(num_experts, dtype=torch.bool))


@torch.library.register_fake("sere::engine_reroute", lib=_LIB)
def _(topk_ids, similarity, S, rho, rank_values):
    return torch.empty_like(topk_ids)


@torch.library.register_fake("sere::engine_range", lib=_LIB)
def _(topk_ids):
    return torch.empty((), dtype=torch.int64)


@torch.library.register_fake("sere::record_routing", lib=_LIB)
def _(before, after, rank_values, rows, layer, S, num_experts):
    return torch.empty_like(after)


# --- attaching -------------------------------------------------------------------------------


def _moe_runners(model):
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface

    return [m for m in model.modules() if isinstance(m, MoERunnerInterface)]


def _monolithic_advice(runner) -> str:
    method = type(getattr(runner, "_quant_method", None) or getattr(runner, "quant_method", None)).__name__
    if "Unquantized" in method or "Fp8" in method:
        return ("select a modular MoE backend, e.g. moe_backend='triton' (--moe-backend triton), which serves "
                f"{method} weights")
    return (f"its weights ({method}) may have no modular MoE kernel on this platform (MXFP4 runs monolithic "
            "kernels only): try moe_backend='triton' (--moe-backend triton); if the layer stays monolithic, this "
            "model cannot be re-routed here")


def engine_layers(runners) -> list[EngineLayer]:
    """The engine's MoE layers (``MoERunner`` objects), refusing kernels that route internally."""
    from vllm.model_executor.models.utils import extract_layer_index

    layers = []
    for runner in runners:
        if runner.is_monolithic:
            raise SettingsError(
                f"{WHERE}: {runner.layer_name} runs a monolithic MoE kernel, which routes inside the kernel, so "
                f"SERE cannot re-route it; {_monolithic_advice(runner)}"
            )
        layers.append(EngineLayer(extract_layer_index(runner.layer_name), runner.layer_name,
                                  runner.moe_config.num_logical_experts, runner.router.top_k))
    return layers


def stats_placement(settings, parallel) -> Placement | None:
    """Where the statistics count the busiest expert-parallel rank: the engine's own EP (size
    TP x DP, its placement strategy), else ``ep_ranks`` / ``ep_placement`` from the settings."""
    if getattr(parallel, "enable_expert_parallel", False):
        size = parallel.tensor_parallel_size * parallel.data_parallel_size
        if size > 1:
            return Placement(size, getattr(parallel, "expert_placement_strategy", "linear"))
    if settings.ep_ranks is not None:
        return Placement(settings.ep_ranks, settings.ep_placement)
    return None


def _dp_all_reduce():
    """A sum all-reduce over vLLM's data-parallel group, on the device (vLLM's own collective)."""
    from vllm.distributed.parallel_state import get_dp_group

    return get_dp_group().all_reduce


def check_engine_config(vllm_config, settings=None) -> None:
    """What the engine's configuration alone tells: refused in the calling process, before any worker starts."""
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1 and not (settings is not None and settings.dp_loaded_set):
        raise SettingsError(
            f"{WHERE}: data_parallel_size {parallel.data_parallel_size} is not supported (expected 1) unless "
            f'{WHERE}["dp_loaded_set"] is true: data-parallel ranks route different batches, so each would '
            "re-route toward its own primary experts; set it (the ranks then agree on one loaded set per layer, a "
            "path verified below the engine only) or use tensor_parallel_size (with enable_expert_parallel)"
        )
    if parallel.use_ubatching:
        raise SettingsError(
            f"{WHERE}: micro-batching (enable_dbo={parallel.enable_dbo}, ubatch_size={parallel.ubatch_size}) runs a "
            "step as several forwards over parts of its rows, which sere-fx cannot tell apart; expected it off "
            "(leave out --enable-dbo and --ubatch-size)"
        )
    pcp = getattr(parallel, "prefill_context_parallel_size", 1)
    if pcp > 1:
        raise SettingsError(
            f"{WHERE}: prefill_context_parallel_size {pcp} is not supported (expected 1): it partitions a step's "
            "rows across ranks, so the rows sere-fx plans are not the rows each rank runs"
        )


def step_readers():
    """``(runner class, input-preparation method, reader)`` for each of vLLM's model runners that
    this vLLM has (``sere_fx.vllm.register`` wraps those methods). A reader returns the step's
    request ids in row order, which of them are prefilling, and the device ``query_start_loc``."""

    def read_v1(runner, _out):
        batch = runner.input_batch
        n = batch.num_reqs
        prefilling = batch.num_computed_tokens_cpu[:n] < batch.num_prompt_tokens[:n]
        return batch.req_ids[:n], prefilling, runner.query_start_loc.gpu[: n + 1]

    def read_v2(_runner, batch):
        return batch.req_ids, batch.is_prefilling_np, batch.query_start_loc

    readers = []
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

        readers.append((V1Runner, "_prepare_inputs", read_v1))
    except ImportError:  # pragma: no cover - depends on the vLLM build
        pass
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

        readers.append((V2Runner, "prepare_inputs", read_v2))
    except ImportError:  # pragma: no cover
        pass
    if not readers:
        raise ImportError("neither of vLLM's model runners (vllm.v1.worker.gpu_model_runner, "
                          "vllm.v1.worker.gpu.model_runner) could be imported")
    return readers


def attach(model, vllm_config, raw, runner=None) -> dict[int, LayerRouting | RangeRouting]:
    """Install the routing of ``raw`` (``additional_config["sere"]``) on every MoE layer of ``model``
    (the served model of ``runner``, whose steps will say which rows are decode rows)."""
    settings = parse(raw)
    check_engine_config(vllm_config, settings)
    kinds = tuple(cls for cls, _, _ in step_readers())
    if runner is not None and not isinstance(runner, kinds):
        raise SettingsError(
            f"{WHERE}: the model runner {type(runner).__name__} is not one whose request state sere-fx reads "
            f"(expected a subclass of {[k.__name__ for k in kinds]}), so decode rows cannot be known"
        )
    runners = _moe_runners(model)
    architecture = (getattr(vllm_config.model_config.hf_config, "architectures", None) or [None])[0]
    if not runners:
        raise SettingsError(f"{WHERE}: the served model ({architecture}) has no MoE layer to re-route")
    layers = engine_layers(runners)
    pipeline = vllm_config.parallel_config.pipeline_parallel_size > 1
    # each layer's calibrated tensor, and a predictor beside a similarity where a layer's ranges read both
    plans, matrices, predictors = resolve_layers(settings, layers, architecture, subset=pipeline, with_predictors=True)
    device = vllm_config.device_config.device
    matrices, predictors = to_device(matrices, device), to_device(predictors, device)
    scheduler = vllm_config.scheduler_config
    ENGINE.allocate(scheduler.max_num_batched_tokens, scheduler.max_num_seqs, device)
    ENGINE.decode_only, ENGINE.spec_decode = settings.decode_only, settings.spec_decode
    ENGINE.stats, ENGINE.rank_stats, ENGINE.owner = {}, {}, {}
    placement = stats_placement(settings, vllm_config.parallel_config)
    ENGINE.ep_ranks = 0 if placement is None else placement.ranks
    reduce = None
    if settings.dp_loaded_set and vllm_config.parallel_config.data_parallel_size > 1:
        reduce = _dp_all_reduce()
        _logger().warning("sere-fx: dp_loaded_set: the %d data-parallel ranks agree on one loaded set per layer "
                          "call (one all-reduce of E or 4E floats); this path is verified below the engine only "
                          "(torch.distributed with gloo), not in a served engine",
                          vllm_config.parallel_config.data_parallel_size)
    installed = {}
    ENGINE.merging = set()
    ranged = {i: p for i, p in plans.items() if isinstance(p, RowRanges)}
    ENGINE.bounds = _common_bounds(ranged)
    ENGINE.range_steps = {}
    for runner_, layer in zip(runners, layers):
        plan = plans[layer.index]
        scores = RouterScores.of(runner_.router)
        for config in plan.configs if isinstance(plan, RowRanges) else (plan,):
            if config.policy in TOPK_POLICIES and scores.unsupported:
                raise SettingsError(
                    f'{WHERE}["policy"]: {config.policy!r} recomputes routing weights, but layer {layer.index} '
                    f"({scores.router}) cannot be reproduced: {scores.unsupported}; use policy 'sere'"
                )
        if (why := predictor_refusal(plan, scores)) is not None:
            raise SettingsError(f'{WHERE}["policy"]: layer {layer.index}: {why}')
        if scores.bias is not None and scores.scoring_func is None:
            raise SettingsError(f"{WHERE}: layer {layer.index} ({scores.router}) ranks experts by a biased score "
                                f"sere-fx cannot recompute ({scores.unsupported})")
        if is_exact(plan, layer.top_k) and not settings.stats:
            uninstall(runner_.router)  # S = K leaves this layer's routing as it is (with stats: counted)
            slots.uninstall(runner_)
            continue
        if not settings.merge_slots:
            slots.uninstall(runner_)
        elif (why := slots.install(runner_)) is None:
            ENGINE.merging.add(layer.index)
        else:
            ENGINE.warn_once(f"merge:{why}", "sere-fx: duplicate and weight-0 token-slots are not merged: %s", why)
        def routing_of(config, tensor):
            return LayerRouting(layer.index, config, scores, tensor, layer.num_experts, settings.stats, reduce,
                                native_rows=ENGINE.native)

        tensor = matrices.get(layer.index)
        if isinstance(plan, RowRanges):
            predictor = predictors.get(layer.index, tensor)  # a predictor beside a similarity, or the layer's one
            routing = RangeRouting(layer.index, plan.bounds, tuple(
                None if isinstance(c, OffConfig) else routing_of(c, predictor if c.needs_predictor else tensor)
                for c in plan.configs))
            if settings.stats:
                ENGINE.range_steps[layer.index] = [0] * len(plan.ranges)
        else:
            routing = routing_of(plan, tensor)
        install(runner_.router, routing)
        installed[layer.index] = routing
        if settings.stats:
            ENGINE.stats[layer.index] = torch.zeros(len(STAT_FIELDS), dtype=torch.float64, device=device)
            if placement is not None:
                ENGINE.owner[layer.index] = placement.owner(layer.num_experts, device=device)
                ENGINE.rank_stats[layer.index] = torch.zeros(len(EP_STAT_FIELDS), dtype=torch.float64, device=device)
    ENGINE.layers = installed
    ENGINE.off_ranges = off_ranges(installed.values(), ENGINE.bounds)
    summary = ", ".join(f"{i}: {_describe(p)}" for i, p in sorted(plans.items()))
    speculative = vllm_config.speculative_config
    _logger().info("sere-fx: re-routing %d of %d MoE layers of %s (%s); decode_only=%s, spec_decode=%s, stats=%s, "
                   "slots merged on %d layers%s",
                   len(installed), len(layers), architecture, summary, settings.decode_only,
                   settings.spec_decode if speculative is not None else "n/a", settings.stats, len(ENGINE.merging),
                   f"; draft model ({speculative.method}) left alone" if speculative is not None else "")
    return installed


def _describe(plan) -> str:
    if isinstance(plan, RowRanges):
        return "[" + "; ".join(f"rows >= {low}: {_describe(c)}" for low, c in plan.ranges) + "]"
    if isinstance(plan, OffConfig):
        return "off"
    return (f"{plan.policy} S={plan.S}" + (f" rho={plan.rho:.3g}" if plan.rho is not None else "")
            + (f" N={plan.N}" if plan.N is not None else ""))


def off_ranges(routings, bounds) -> frozenset[int]:
    """The ranges in which every installed layer is ``off`` (none with a plan of one range, or
    when a layer routes by one setting for every step: its routing reads the masks each step)."""
    routings = list(routings)
    if bounds is None or not all(isinstance(r, RangeRouting) for r in routings):
        return frozenset()
    return frozenset(i for i in range(len(bounds)) if all(r.routings[i] is None for r in routings))


def _common_bounds(ranged: dict) -> tuple[int, ...] | None:
    """The ranges' lower bounds, one set for every layer (a plan file's ranges are), else refused."""
    bounds = {p.bounds for p in ranged.values()}
    if len(bounds) > 1:
        raise SettingsError(f'{WHERE}["plan"]: expected the same ranges on every layer (the step picks one range '
                            f"for all), got {sorted(bounds)}")
    return bounds.pop() if bounds else None


def switch_routing(worker, raw) -> None:
    """Between passes of an eager engine (``sere_fx.vllm.evaluate``): route every MoE layer by
    ``raw`` (``additional_config["sere"]``'s form), or by the model's own routing for None."""
    model = worker.model_runner.get_model()
    if raw is not None:
        attach(model, worker.vllm_config, raw, worker.model_runner)
        return
    for runner in _moe_runners(model):
        uninstall(runner.router)
        slots.uninstall(runner)
    ENGINE.layers, ENGINE.stats, ENGINE.rank_stats, ENGINE.merging = {}, {}, {}, set()
    ENGINE.bounds, ENGINE.range_steps, ENGINE.off_ranges = None, {}, frozenset()


def worker_stats(worker=None) -> dict[int, dict[str, float]]:
    """This worker's counters as ``{layer: {field: sum}}`` (empty when stats are off)."""
    out = {layer: dict(zip(STAT_FIELDS, acc.tolist())) for layer, acc in sorted(ENGINE.stats.items())}
    for layer, acc in ENGINE.rank_stats.items():
        out[layer].update(zip(EP_STAT_FIELDS, acc.tolist()))
    for layer, counts in ENGINE.range_steps.items():  # plans that follow the load: steps per range
        out[layer].update({range_key(low): float(c) for low, c in zip(ENGINE.bounds, counts)})
    return out


def range_key(min_rows: int) -> str:
    """The statistic of a range: steps (with re-routed rows) whose row count fell in the range from ``min_rows``."""
    return f"{RANGE_PREFIX}{min_rows}"


def reset_worker_stats(worker=None) -> None:
    for acc in (*ENGINE.stats.values(), *ENGINE.rank_stats.values()):
        acc.zero_()
    for counts in ENGINE.range_steps.values():
        counts[:] = [0] * len(counts)
