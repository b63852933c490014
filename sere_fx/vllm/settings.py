"""The plugin's settings: ``additional_config["sere"]``, checked against the served model.

Everything a user can get wrong fails engine start with one message that names the key
(``additional_config["sere"]["S"]: ...``). ``parse`` checks every key's type and range (and
reads the plan file) in the calling process, before any worker starts; only what the model
tells (S against each layer's top-k, the similarity file against its layers) waits for the
workers. Settings are parsed into the same routing configs as ``transform``'s
(``sere_fx.config.routing_spec`` / ``plan_for_layers``), and similarity files go through the same
``sere_fx.similarity.resolve``, so a setting means the same thing in both front-ends.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from sere_fx.config import (
    cache_policy,
    INDEX_POLICIES,
    LayerInfo,
    Quantile,
    RoutingConfig,
    plan_for_layers,
    needs_similarity,
    restrict,
    routing_spec,
    spec_policies,
)
from sere_fx.errors import ArgumentError
from sere_fx.plan import load_plan
from sere_fx.similarity import Similarity, layer_predictors, layer_tensors, resolve

SETTINGS_KEY = "sere"
WHERE = f'additional_config["{SETTINGS_KEY}"]'
_KEYS = ("sim", "S", "rho", "N", "policy", "plan", "decode_only", "spec_decode", "stats", "dp_loaded_set", "ep_ranks",
         "ep_placement", "merge_slots")
SPEC_DECODE = ("reroute", "keep")
# The per-request switch: SamplingParams(extra_args={"sere": False}) keeps a request's rows on
# the model's routing (``"vllm_xargs": {"sere": false}`` through the OpenAI server).
REQUEST_KEY = "sere"
# The statistic of a plan's range in routing_stats and /metrics: steps whose row count fell in the
# range from min_rows (``sere_fx.vllm.engine.range_key``).
RANGE_PREFIX = "range_steps_from_"


class SettingsError(ValueError):
    """A bad ``additional_config["sere"]``: the message names the key, the expected and the actual value."""


EngineLayer = LayerInfo  # one MoE layer as the engine built it (what plan_for_layers and resolve need)


@dataclass(frozen=True)
class EngineSettings:
    sim: str | None = None
    S: object = None  # None: not given (the config's default)
    rho: object = None
    N: object = None
    policy: object = None
    plan: str | None = None
    decode_only: bool = True
    spec_decode: str = "reroute"
    stats: bool = False
    dp_loaded_set: bool = False  # data-parallel ranks agree on one primary / loaded set per layer call
    ep_ranks: int | None = None  # statistics also count the busiest of this many EP ranks
    ep_placement: str = "linear"
    merge_slots: bool = True  # the CPU kernel computes each token's distinct experts once (sere_fx.vllm.slots)
    raw: dict = field(default_factory=dict, compare=False)
    routing: object = field(default=None, compare=False)  # the settings as configs (config.routing_spec)

    @property
    def policies(self) -> set[str]:
        """Every policy some layer is given (by the plan file or by ``policy``)."""
        return spec_policies(self.routing)


def _key(name: str) -> str:
    return f'{WHERE}["{name}"]'


def _per_layer_keys(name: str, value):
    """JSON objects have string keys: ``{"3": 2}`` means decoder layer 3."""
    if not isinstance(value, Mapping):
        return value
    out = {}
    for k, v in value.items():
        if isinstance(k, int) and not isinstance(k, bool):
            out[k] = v
        elif isinstance(k, str) and k.strip().isdigit():
            out[int(k)] = v
        else:
            raise SettingsError(f"{_key(name)}: expected decoder-layer indices as keys, got {k!r}")
    return out


def _rho(value):
    """A number, ``{"quantile": q}``, a ``Quantile``, or a per-layer mapping of those."""
    if isinstance(value, Mapping) and set(value) == {"quantile"}:
        return Quantile(value["quantile"])
    if isinstance(value, Mapping):
        return {k: _rho(v) for k, v in _per_layer_keys("rho", value).items()}
    return value


def _raise_named(exc: ArgumentError):
    """A config error, its argument said as the settings key."""
    if exc.arg in _KEYS:
        raise SettingsError(exc.said_as(_key(exc.arg))) from None
    raise SettingsError(f"{WHERE}: {exc}") from None


def parse(raw) -> EngineSettings:
    """Check every key of ``additional_config["sere"]`` that the model does not decide: names,
    types, ranges, files, and the plan file's contents."""
    if not isinstance(raw, Mapping):
        raise SettingsError(f"{WHERE}: expected an object with keys {list(_KEYS)}, got {type(raw).__name__} {raw!r}")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise SettingsError(f"{WHERE}: unknown key {unknown[0]!r}; expected keys among {list(_KEYS)}")
    for name in ("decode_only", "stats", "dp_loaded_set", "merge_slots"):
        if name in raw and not isinstance(raw[name], bool):
            raise SettingsError(f"{_key(name)}: expected true or false, got {raw[name]!r}")
    spec_decode = raw.get("spec_decode", "reroute")
    if spec_decode not in SPEC_DECODE:
        raise SettingsError(f"{_key('spec_decode')}: expected one of {list(SPEC_DECODE)}, got {spec_decode!r}")
    for name in ("sim", "plan"):
        value = raw.get(name)
        if value is None:
            continue
        if not isinstance(value, (str, os.PathLike)):
            raise SettingsError(f"{_key(name)}: expected a file path, got {value!r} ({type(value).__name__})")
        if not os.path.isfile(value):
            raise SettingsError(f"{_key(name)}: expected an existing file, got {os.fspath(value)!r} (not found)")
    try:
        rho = _rho(raw.get("rho"))
    except ValueError as exc:
        raise SettingsError(f"{_key('rho')}: {exc}") from None
    ep_ranks, ep_placement = raw.get("ep_ranks"), raw.get("ep_placement", "linear")
    if ep_ranks is not None and (isinstance(ep_ranks, bool) or not isinstance(ep_ranks, int) or ep_ranks < 1):
        raise SettingsError(f"{_key('ep_ranks')}: expected a positive int (expert-parallel ranks), got {ep_ranks!r}")
    if ep_placement not in ("linear", "round_robin"):
        raise SettingsError(f"{_key('ep_placement')}: expected 'linear' or 'round_robin', got {ep_placement!r}")
    if ("ep_ranks" in raw or "ep_placement" in raw) and not raw.get("stats", False):
        given = "ep_ranks" if "ep_ranks" in raw else "ep_placement"
        raise SettingsError(f"{_key(given)}: only the statistics read it; expected \"stats\": true with it, got "
                            f"{raw[given]!r} without")
    if "ep_placement" in raw and ep_ranks is None:
        raise SettingsError(f"{_key('ep_placement')}: only used with \"ep_ranks\", got {ep_placement!r} without it")
    plan = raw.get("plan")
    if plan is not None:
        given = [name for name in ("policy", "S", "rho", "N") if name in raw]
        if given:
            raise SettingsError(f"{_key(given[0])}: the plan file sets it per layer; expected it left out with "
                                f"\"plan\", got {raw[given[0]]!r}")
        try:
            routing = load_plan(plan)
        except ArgumentError as exc:
            if getattr(exc, "layer", None) is not None:
                raise SettingsError(f"{_key('plan')}: layer {exc.layer} of {os.fspath(plan)!r}: {exc.detail}") from None
            raise SettingsError(f"{_key('plan')}: {exc}") from None
    else:
        try:
            routing = routing_spec(policy=_per_layer_keys("policy", raw.get("policy")), S=_per_layer_keys("S", raw.get("S")),
                                   rho=rho, N=_per_layer_keys("N", raw.get("N")))
        except ArgumentError as exc:
            _raise_named(exc)
    settings = EngineSettings(
        sim=raw.get("sim"),
        S=_per_layer_keys("S", raw.get("S")),
        rho=rho,
        N=_per_layer_keys("N", raw.get("N")),
        policy=_per_layer_keys("policy", raw.get("policy")),
        plan=plan,
        decode_only=raw.get("decode_only", True),
        spec_decode=spec_decode,
        stats=raw.get("stats", False),
        dp_loaded_set=raw.get("dp_loaded_set", False),
        ep_ranks=ep_ranks,
        ep_placement=ep_placement,
        merge_slots=raw.get("merge_slots", True),
        raw=dict(raw),
        routing=routing,
    )
    if (p := cache_policy(routing)) is not None:
        raise SettingsError(f"{_key('policy')}: {p!r} biases routing toward an offload cache's resident experts, and "
                            "the plugin serves models whose experts stay in the engine's memory; expected another "
                            "policy, got it")
    needing = sorted(settings.policies & set(INDEX_POLICIES))
    if settings.sim is None and needs_similarity(routing):
        raise SettingsError(f"{_key('sim')}: policy {needing[0]!r} needs a similarity file from `sere-fx calibrate`, "
                            "got none")
    return settings


def request_reroutes(extra_args) -> bool:
    """Whether a request's rows are re-routed: ``extra_args["sere"]`` true (the default) or false.
    The OpenAI server's ``vllm_xargs`` turns JSON true / false into 1 / 0; anything else (a string
    ``"false"``, 2, null) is refused, naming the key."""
    value = (extra_args or {}).get(REQUEST_KEY, True)
    if isinstance(value, (bool, int)) and value in (0, 1):
        return bool(value)
    raise SettingsError(f'extra_args["{REQUEST_KEY}"] ("vllm_xargs" through the OpenAI server): expected true or '
                        f"false, got {value!r} ({type(value).__name__})")


def ignored_similarity(settings: EngineSettings) -> str | None:
    """A warning when a similarity file is given but no layer's policy reads it, else None."""
    if settings.sim is None or needs_similarity(settings.routing):
        return None
    return (f"sere-fx: {_key('sim')} is ignored: policy {sorted(settings.policies)} ranks experts by the router's "
            f"scores and reads no similarity (only {list(INDEX_POLICIES)} do)")


def resolve_layers(settings: EngineSettings, layers: list[EngineLayer], architecture: str | None,
                   subset: bool = False, with_predictors: bool = False):
    """Per-layer plans and similarity matrices for the engine's MoE layers.

    ``subset``: the engine holds only some of the model's layers (a pipeline-parallel stage):
    per-layer settings and the similarity file may cover more layers, and each stage takes its own.
    Returns ``({layer: RoutingConfig}, {layer: tensor} or None)``: each layer's calibrated tensor
    (``sere_fx.similarity.layer_tensors``: a similarity matrix, or ``output``'s predictor), for the
    layers whose policy reads one; None without a similarity file. ``with_predictors``: a third item,
    ``{layer: predictor}`` for the layers whose ranges read a predictor beside a similarity
    (``sere_fx.similarity.layer_predictors``; empty without a similarity file).
    """
    routing = settings.routing
    if subset:
        routing = restrict(routing, [layer.index for layer in layers])
    matrices = None
    if settings.sim is not None:
        try:
            sim = Similarity.load(settings.sim)
        except Exception as exc:  # a truncated or foreign file: safetensors' own error says why
            raise SettingsError(f"{_key('sim')}: cannot read {settings.sim!r} as a similarity file ({exc})") from None
        calibrated_on = sim.metadata.get("architecture")
        if calibrated_on and architecture and calibrated_on != architecture:
            raise SettingsError(
                f"{_key('sim')}: calibrated on a {calibrated_on} model, but the engine serves {architecture}"
            )
        try:
            if subset:
                if not {layer.index for layer in layers} <= set(sim):
                    raise ValueError(f"expected matrices for this pipeline stage's MoE decoder layers "
                                     f"{[layer.index for layer in layers]}, got layers {sorted(sim)}")
                sim = Similarity({layer.index: sim[layer.index] for layer in layers}, sim.metadata,
                                 {layer.index: sim.predictors[layer.index] for layer in layers
                                  if layer.index in sim.predictors})
            matrices = resolve(sim, layers)
        except (ValueError, TypeError) as exc:
            raise SettingsError(f"{_key('sim')}: {exc}") from None
    try:
        plans: dict[int, RoutingConfig] = plan_for_layers(routing, layers, matrices)
    except ArgumentError as exc:
        _raise_named(exc)
    if settings.sim is None:
        return (plans, None, {}) if with_predictors else (plans, None)
    try:
        tensors = layer_tensors(sim, layers, plans, matrices)
        if not with_predictors:
            return plans, tensors
        return plans, tensors, layer_predictors(sim, layers, plans)
    except ArgumentError as exc:
        raise SettingsError(f"{_key('sim')}: {exc.message.removeprefix('sim: ')}") from None


def to_device(matrices, device) -> dict[int, torch.Tensor]:
    return {i: m.to(device=device, dtype=torch.float32).contiguous() for i, m in (matrices or {}).items()}
