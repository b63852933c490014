"""sere-fx inside vLLM: SERE and OEA in the engine that serves batched decode.

Installed as a ``vllm.general_plugins`` entry point, so vLLM loads it in the engine and in
every worker. Nothing changes unless the engine is started with ``additional_config={"sere":
{...}}`` (``--additional-config '{"sere": {...}}'`` for the OpenAI server); then every MoE
layer's router output goes through the layer's policy (``sere_fx.vllm.routing``).

    llm = LLM(model=path, additional_config={"sere": {"sim": "sim.safetensors", "S": 2, "rho": 0.0}})
    sere_fx.vllm.routing_stats(llm)   # with "stats": true
"""

from __future__ import annotations

_REGISTERED = False


def register() -> None:
    """The entry point: hook model loading and forward steps (idempotent; cheap when unused)."""
    global _REGISTERED
    if _REGISTERED:
        return
    import functools

    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import ForwardContext
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.v1.worker.worker_base import WorkerBase

    from sere_fx.vllm import engine
    from sere_fx.vllm.settings import SETTINGS_KEY, parse

    load_model = BaseModelLoader.load_model

    @functools.wraps(load_model)
    def load_model_with_sere(self, vllm_config, model_config, *args, **kwargs):
        model = load_model(self, vllm_config, model_config, *args, **kwargs)
        extra = vllm_config.additional_config
        # Only the served model: a speculative-decoding draft model is loaded through here too.
        is_target = model_config is vllm_config.model_config
        if is_target and isinstance(extra, dict) and extra.get(SETTINGS_KEY) is not None:
            engine.attach(model, vllm_config, extra[SETTINGS_KEY])
        return model

    create_engine_config = EngineArgs.create_engine_config

    @functools.wraps(create_engine_config)
    def create_engine_config_checked(self, *args, **kwargs):
        # Model-independent mistakes (keys, types, missing files) fail here, in the calling
        # process, before any worker starts; the rest fails in the workers once the model is built.
        config = create_engine_config(self, *args, **kwargs)
        extra = config.additional_config
        if isinstance(extra, dict) and extra.get(SETTINGS_KEY) is not None:
            parse(extra[SETTINGS_KEY])
        return config

    post_init = ForwardContext.__post_init__

    @functools.wraps(post_init)
    def post_init_with_rows(self):
        post_init(self)
        if engine.ENGINE.layers:
            engine.ENGINE.refresh(self.attn_metadata)

    BaseModelLoader.load_model = load_model_with_sere
    EngineArgs.create_engine_config = create_engine_config_checked
    ForwardContext.__post_init__ = post_init_with_rows
    WorkerBase.sere_routing_stats = engine.worker_stats
    WorkerBase.sere_reset_routing_stats = engine.reset_worker_stats
    _REGISTERED = True


def routing_stats(llm) -> dict[int, dict[str, float]]:
    """Per MoE layer, means per decode step: ``{layer: {"decode_steps", "decode_rows", "prefill_rows",
    "distinct_before", "distinct_after", "slots_rerouted", "critical_kept"}}`` (``decode_steps`` is the
    count of layer calls that had decode rows; ``prefill_rows`` counts rows of mixed batches that kept
    the model's routing).

    Gathered from every worker; tensor-parallel ranks route the same tokens the same way, and
    a disagreement raises. Needs ``"stats": true`` in the settings.
    """
    per_rank = llm.collective_rpc("sere_routing_stats")
    if not per_rank or not per_rank[0]:
        raise ValueError('llm: started without "stats": true in additional_config["sere"]; no statistics recorded')
    first = per_rank[0]
    for rank, other in enumerate(per_rank[1:], start=1):
        if other != first:
            raise RuntimeError(f"routing statistics of rank {rank} differ from rank 0: {other} vs {first}")
    out = {}
    for layer, sums in first.items():
        steps = sums["decode_steps"]
        out[int(layer)] = {k: (v if k == "decode_steps" else (v / steps if steps else 0.0)) for k, v in sums.items()}
        out[int(layer)]["decode_steps"] = int(steps)
    return out


def reset_routing_stats(llm) -> None:
    """Zero the statistics on every worker (e.g. after a warm-up)."""
    llm.collective_rpc("sere_reset_routing_stats")
