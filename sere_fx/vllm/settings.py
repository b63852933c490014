"""The plugin's settings: ``additional_config["sere"]``, checked against the served model.

Everything a user can get wrong fails engine start with one message that names the key
(``additional_config["sere"]["S"]: ...``). ``parse`` checks every key's type and range (and
reads the plan file) in the calling process, before any worker starts; only what the model
tells (S against each layer's top-k, the similarity file against its layers) waits for the
workers. Per-layer settings go through the same
``sere_fx.plan.build_plan`` as ``transform``, and similarity files through the same
``sere_fx.similarity.resolve``, so a setting means the same thing in both front-ends.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from sere_fx.plan import LayerPlan, Quantile, build_plan, check_settings, load_plan, plan_settings
from sere_fx.policies import INDEX_POLICIES
from sere_fx.similarity import Similarity, resolve

SETTINGS_KEY = "sere"
WHERE = f'additional_config["{SETTINGS_KEY}"]'
_KEYS = ("sim", "S", "rho", "N", "policy", "plan", "decode_only", "spec_decode", "stats")
SPEC_DECODE = ("reroute", "keep")


class SettingsError(ValueError):
    """A bad ``additional_config["sere"]``: the message names the key, the expected and the actual value."""


@dataclass(frozen=True)
class EngineLayer:
    """One MoE layer as the engine built it (what ``build_plan`` and ``resolve`` need)."""

    index: int  # decoder-layer index, as in similarity files and plans
    name: str  # the engine's layer name, e.g. model.layers.3.mlp.experts
    num_experts: int  # logical (global) experts
    top_k: int


@dataclass(frozen=True)
class EngineSettings:
    sim: str | None = None
    S: object = 2
    rho: object = None
    N: object = None
    policy: object = "sere"
    plan: str | None = None
    decode_only: bool = True
    spec_decode: str = "reroute"
    stats: bool = False
    raw: dict = field(default_factory=dict, compare=False)
    plan_layers: dict | None = field(default=None, compare=False)  # the plan file as read by ``parse``

    @property
    def policies(self) -> set[str]:
        """Every policy some layer is given (by the plan file or by ``policy``)."""
        if self.plan_layers is not None:
            return {lp.policy for lp in self.plan_layers.values()}
        return set(self.policy.values()) if isinstance(self.policy, Mapping) else {self.policy}


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


def _raise_named(exc: Exception):
    """A ``build_plan`` / ``check_settings`` error, its argument said as the settings key."""
    name = str(exc).split(":", 1)[0].split("[", 1)[0]
    raise SettingsError(f"{_key(name)}{str(exc)[len(name):]}" if name in _KEYS else f"{WHERE}: {exc}") from None


def parse(raw) -> EngineSettings:
    """Check every key of ``additional_config["sere"]`` that the model does not decide: names,
    types, ranges, files, and the plan file's contents."""
    if not isinstance(raw, Mapping):
        raise SettingsError(f"{WHERE}: expected an object with keys {list(_KEYS)}, got {type(raw).__name__} {raw!r}")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise SettingsError(f"{WHERE}: unknown key {unknown[0]!r}; expected keys among {list(_KEYS)}")
    for name in ("decode_only", "stats"):
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
    plan_layers = None
    if raw.get("plan") is not None:
        given = [name for name in ("policy", "S", "rho", "N") if name in raw]
        if given:
            raise SettingsError(f"{_key(given[0])}: the plan file sets it per layer; expected it left out with "
                                f"\"plan\", got {raw[given[0]]!r}")
        try:
            plan_layers = load_plan(raw["plan"])
        except (ValueError, TypeError, OSError) as exc:
            raise SettingsError(f"{_key('plan')}: {exc}") from None
        for i, lp in sorted(plan_layers.items()):
            try:
                check_settings(lp.policy, lp.S, lp.rho, lp.N)
            except (ValueError, TypeError) as exc:
                raise SettingsError(f"{_key('plan')}: layer {i} of {os.fspath(raw['plan'])!r}: {exc}") from None
    settings = EngineSettings(
        sim=raw.get("sim"),
        S=_per_layer_keys("S", raw.get("S", 2)),
        rho=rho,
        N=_per_layer_keys("N", raw.get("N")),
        policy=_per_layer_keys("policy", raw.get("policy", "sere")),
        plan=raw.get("plan"),
        decode_only=raw.get("decode_only", True),
        spec_decode=spec_decode,
        stats=raw.get("stats", False),
        raw=dict(raw),
        plan_layers=plan_layers,
    )
    if plan_layers is None:
        try:
            check_settings(settings.policy, settings.S, settings.rho, settings.N)
        except (ValueError, TypeError) as exc:
            _raise_named(exc)
    needing = sorted(settings.policies & set(INDEX_POLICIES))
    if settings.sim is None and needing:
        raise SettingsError(f"{_key('sim')}: policy {needing[0]!r} needs a similarity file from `sere-fx calibrate`, "
                            "got none")
    return settings


def ignored_similarity(settings: EngineSettings) -> str | None:
    """A warning when a similarity file is given but no layer's policy reads it, else None."""
    if settings.sim is None or settings.policies & set(INDEX_POLICIES):
        return None
    return (f"sere-fx: {_key('sim')} is ignored: policy {sorted(settings.policies)} ranks experts by the router's "
            f"scores and reads no similarity (only {list(INDEX_POLICIES)} do)")


def _only(value, indices):
    """A per-layer mapping cut to ``indices`` (a pipeline stage's layers); scalars unchanged."""
    return {i: value[i] for i in indices if i in value} if isinstance(value, Mapping) else value


def resolve_layers(settings: EngineSettings, layers: list[EngineLayer], architecture: str | None,
                   subset: bool = False):
    """Per-layer plans and similarity matrices for the engine's MoE layers.

    ``subset``: the engine holds only some of the model's layers (a pipeline-parallel stage):
    per-layer settings and the similarity file may cover more layers, and each stage takes its own.
    Returns ``({layer: LayerPlan}, {layer: float32 [E, E]} or None)``.
    """
    policy, S, rho, N = settings.policy, settings.S, settings.rho, settings.N
    if settings.plan_layers is not None:  # parse refused plan together with these keys
        policy, S, rho, N = plan_settings(settings.plan_layers)
    if subset:
        indices = [layer.index for layer in layers]
        policy, S, rho, N = (_only(v, indices) for v in (policy, S, rho, N))
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
                sim = Similarity({layer.index: sim[layer.index] for layer in layers}, sim.metadata)
            matrices = resolve(sim, layers)
        except (ValueError, TypeError) as exc:
            raise SettingsError(f"{_key('sim')}: {exc}") from None
    try:
        plans: dict[int, LayerPlan] = build_plan(layers, policy, S, rho, matrices, N)
    except (ValueError, TypeError) as exc:
        _raise_named(exc)
    return plans, matrices


def to_device(matrices, device) -> dict[int, torch.Tensor]:
    return {i: m.to(device=device, dtype=torch.float32).contiguous() for i, m in (matrices or {}).items()}
