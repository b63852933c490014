"""Routing configs: one frozen dataclass per policy, and the one place their defaults live.

    sere_fx.transform(model, sim, SereConfig(S=2, rho=0.5))
    sere_fx.transform(model, None, {3: OEAConfig(S=2), 5: WeightConfig(S=1, N=0.6)})  # per layer
    sere_fx.transform(model, sim, S=2, rho=0.5)  # the keyword spelling: parsed into SereConfig

A config checks its own values when it is built (types and ranges, nothing that depends on a
model); ``for_layer`` checks it against one MoE layer (S against the layer's top-k) and
resolves a ``Quantile`` rho on the layer's similarity matrix. ``plan_for_layers`` turns any of
the spellings (one config, ``{layer: config}``, the keyword bundle ``Keywords``) into one
config per MoE layer; ``transform``, the compile backend, exporters, ``eval`` specs, plan files,
the CLI and the vLLM settings all go through it. Errors are ``ArgumentError``s: ``err.arg`` is
the argument's name (a per-layer value adds ``[layer]`` to the message).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from sere_fx.errors import ArgumentError, argument_error
from sere_fx.placement import Placement


@dataclass(frozen=True)
class Quantile:
    """``rho`` as the q-quantile of a layer's off-diagonal similarities (q in [0, 1])."""

    q: float

    def __post_init__(self):
        if isinstance(self.q, bool) or not (isinstance(self.q, (int, float)) and 0 <= self.q <= 1):
            raise argument_error("Quantile.q", f"Quantile.q: expected a number in [0, 1], got {self.q!r}")

    def resolve(self, matrix: torch.Tensor) -> float:
        e = matrix.shape[0]
        off = matrix[~torch.eye(e, dtype=torch.bool, device=matrix.device)].double()
        return float(torch.quantile(off, self.q)) if off.numel() else 0.0


class MoELayerInfo(Protocol):
    """What a config needs to know of an MoE layer (``discovery.MoELayer``, ``LayerInfo``)."""

    index: int  # decoder-layer index, as in similarity files and plans
    name: str
    num_experts: int
    top_k: int


@dataclass(frozen=True)
class LayerInfo:
    """An MoE layer seen by a front-end that has no module to trace (a compiled graph, an engine)."""

    index: int
    name: str  # e.g. model.layers.3.mlp.experts
    num_experts: int  # logical (global) experts
    top_k: int


def finite_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise argument_error(name, f"{name}: expected a finite float, got {value!r} ({type(value).__name__})", TypeError)
    if not math.isfinite(value):
        raise argument_error(name, f"{name}: expected a finite float, got {value}")
    return float(value)


def _check_top_k(S: int, layer: MoELayerInfo) -> None:
    if not 1 <= S <= layer.top_k:
        raise argument_error("S", f"S: expected an integer in [1, {layer.top_k}] (top-k of {layer.name}), got {S}")


@dataclass(frozen=True)
class RoutingConfig:
    """Settings every policy has: ``S``, the experts each token keeps as its own (``k0`` for OEA)."""

    S: int = 2

    policy: ClassVar[str]
    needs_similarity: ClassVar[bool] = False  # reads an expert-similarity matrix (an index policy)
    needs_predictor: ClassVar[bool] = False  # reads an output-size predictor (from the same calibration file)
    needs_cache: ClassVar[bool] = False  # reads an offload cache's resident set (``sere_fx.offload``)
    rho = None  # the field of the index policies (``weight``: its importance threshold)
    N = None  # ``weight`` only: its expert budget

    def __post_init__(self):
        if isinstance(self.S, bool) or not isinstance(self.S, int):
            raise argument_error("S", f"S: expected an int, got {self.S!r} ({type(self.S).__name__})", TypeError)
        if self.S < 1:
            raise argument_error("S", f"S: expected an integer >= 1, got {self.S}")

    @property
    def layer_tensor(self) -> bool:
        """Whether the policy reads a calibrated per-layer tensor (``sere_fx.similarity.layer_tensors``)."""
        return self.needs_similarity or self.needs_predictor

    def for_layer(self, layer: MoELayerInfo, matrix: torch.Tensor | None = None) -> "RoutingConfig":
        """This config checked against ``layer`` (and with a ``Quantile`` resolved on ``matrix``)."""
        _check_top_k(self.S, layer)
        return self

    def as_dict(self) -> dict:
        """The plan-file entry: ``{"policy", "S", "rho"}`` (and ``"N"`` for ``weight`` with a budget)."""
        d = {"policy": self.policy, "S": self.S, "rho": self.rho}
        if self.N is not None:
            d["N"] = self.N
        return d


@dataclass(frozen=True)
class SereConfig(RoutingConfig):
    """``sere``: a token's experts past its top-S go to the most similar primary expert, unless even
    the best match is below ``rho`` (a float, or a ``Quantile`` of the layer's similarities)."""

    rho: float | Quantile = 0.5

    policy: ClassVar[str] = "sere"
    needs_similarity: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.rho, Quantile):
            object.__setattr__(self, "rho", finite_float("rho", self.rho))

    def for_layer(self, layer, matrix=None):
        super().for_layer(layer)
        if isinstance(self.rho, Quantile):
            if matrix is None:
                raise argument_error("rho", f"rho: {self.rho!r} is resolved on a similarity matrix; "
                                            f"got none for layer {layer.index}")
            return dataclasses.replace(self, rho=self.rho.resolve(matrix))
        return self


@dataclass(frozen=True)
class LeastSimilarConfig(SereConfig):
    """Ablation: SERE's primary and critical experts, a re-routed slot to the *least* similar primary."""

    policy: ClassVar[str] = "least_similar"


@dataclass(frozen=True)
class RandomConfig(SereConfig):
    """Ablation: SERE's primary and critical experts, a re-routed slot to a random primary."""

    policy: ClassVar[str] = "random"


@dataclass(frozen=True)
class TopKConfig(RoutingConfig):
    """``topk``: each token keeps only its top-S experts."""

    policy: ClassVar[str] = "topk"


@dataclass(frozen=True)
class OEAConfig(RoutingConfig):
    """``oea``: each token keeps its top-S and refills its other slots from the batch's loaded set."""

    policy: ClassVar[str] = "oea"


@dataclass(frozen=True)
class WeightConfig(RoutingConfig):
    """``weight``: the loaded set is every token's top-S, plus experts whose importance is at least
    ``min_importance``, at most ``N`` in all (an int: a count; a float in (0, 1): that fraction of
    the experts the call's tokens picked). Give ``N``, ``min_importance`` or both.

    Under expert parallelism, ``rank_budget`` with ``placement`` (a ``sere_fx.Placement``) also caps
    each rank: at most ``rank_budget`` loaded experts on any rank (an int, or a float in (0, 1):
    that fraction of what the call's tokens picked on the rank)."""

    N: int | float | None = None
    min_importance: float | None = None
    rank_budget: int | float | None = None
    placement: Placement | None = None

    policy: ClassVar[str] = "weight"

    def __post_init__(self):
        super().__post_init__()
        m = self.min_importance
        if isinstance(m, Quantile):
            raise argument_error("min_importance", f"min_importance: policy {self.policy!r} takes an importance threshold "
                                                   f"(a float >= 0), not a similarity quantile; got {m!r}")
        if m is not None:
            m = finite_float("min_importance", m)
            if m < 0:
                raise argument_error("min_importance", "min_importance: expected an importance threshold >= 0 for "
                                                       f"policy {self.policy!r}, got {m}")
            object.__setattr__(self, "min_importance", m)
        if self.N is None and m is None and self.rank_budget is None:
            raise argument_error("N", f"N: policy {self.policy!r} needs N (experts per call), min_importance (an "
                                      "importance threshold) or both; got neither")
        _check_budget("N", self.N, "experts per call", "the experts the call's tokens picked")
        _check_budget("rank_budget", self.rank_budget, "experts per rank per call",
                      "the experts the call's tokens picked on the rank")
        if (self.rank_budget is None) != (self.placement is None):
            raise argument_error("placement", "placement: a per-rank budget needs a placement and a placement a "
                                              f"per-rank budget; got rank_budget={self.rank_budget!r}, "
                                              f"placement={self.placement!r}")
        if self.placement is not None and not isinstance(self.placement, Placement):
            raise argument_error("placement", f"placement: expected a sere_fx.Placement, got "
                                              f"{type(self.placement).__name__}", TypeError)

    def for_layer(self, layer, matrix=None):
        super().for_layer(layer)
        if self.placement is not None:
            self.placement.owner(layer.num_experts)  # an explicit map must cover the layer's experts
        return self

    @property
    def rho(self) -> float | None:  # the keyword spelling and plan files call it rho
        return self.min_importance

    def as_dict(self) -> dict:
        d = super().as_dict()
        if self.rank_budget is not None:
            d["rank_budget"] = self.rank_budget
            d["placement"] = {k: v for k, v in dataclasses.asdict(self.placement).items() if v is not None}
            if "owners" in d["placement"]:
                d["placement"]["owners"] = list(d["placement"]["owners"])
        return d


@dataclass(frozen=True)
class OutputConfig(WeightConfig):
    """``output``: ``weight`` with each token's squared share of an expert scaled by the squared norm the
    expert's output is predicted to have for it (``sere_fx.policies``); reads the output-size predictors
    that ``sere-fx calibrate`` writes into the similarity file. Fields as ``WeightConfig``."""

    policy: ClassVar[str] = "output"
    needs_predictor: ClassVar[bool] = True


@dataclass(frozen=True)
class PriorConfig(RoutingConfig):
    """``prior`` (the Cache-Prior rule, for offloaded models): each token keeps its top-S and picks its
    other experts with the resident ones' scores lifted by ``rho`` times its score range, so it takes a
    resident expert over a missing one unless the missing one is far ahead (``sere_fx.policies.prior_select``).
    ``rho``: the prior's strength, a float >= 0 (0: the model's own routing)."""

    S: int = 1
    rho: float = 0.5

    policy: ClassVar[str] = "prior"
    needs_cache: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        rho = finite_float("rho", self.rho)
        if rho < 0:
            raise argument_error("rho", f"rho: expected the prior's strength, a float >= 0, got {rho}")
        object.__setattr__(self, "rho", rho)


@dataclass(frozen=True)
class OffConfig(RoutingConfig):
    """``off``: the model's own routing. No op is called and nothing is re-routed: the layer computes
    exactly as without sere-fx. A setting of plans whose ranges leave some batch sizes alone
    (``RowRanges``); not a policy of its own (``transform(model, None, OffConfig())`` is the plain model)."""

    policy: ClassVar[str] = "off"

    def for_layer(self, layer, matrix=None):
        return self  # S is not read

    def as_dict(self) -> dict:
        return {"policy": "off"}


OFF = OffConfig()


def range_index(bounds, rows) -> int:
    """Which range of a plan that follows the load a call of ``rows`` rows uses: the last one whose
    lower bound (``bounds``: ascending ``min_rows``, the first 1) is at most ``rows`` (0 rows: the first).
    The one rule every front-end applies (``policies._by_rows``, the vLLM plugin's step)."""
    i = 0
    for j, low in enumerate(bounds):
        if rows >= low:
            i = j
    return i


def is_exact(plan: RoutingConfig, top_k: int) -> bool:
    """Whether ``plan`` leaves every call's routing as the model's: off, or S >= K (every token keeps its
    own experts), in every range of a ``RowRanges``."""
    configs = plan.configs if isinstance(plan, RowRanges) else (plan,)
    return all(isinstance(c, OffConfig) or c.S >= top_k for c in configs)


@dataclass(frozen=True, init=False)
class RowRanges(RoutingConfig):
    """Settings that follow the load: ``ranges`` is ``((min_rows, config), ...)``, ascending from 1; a call
    (a decode step) with ``rows`` re-routed rows uses the config of the last range whose ``min_rows`` is
    at most ``rows`` (``select``). A config may be ``OFF``. Plan files spell it as ``{"ranges":
    [{"min_rows": 1, "layers": {...}}, ...]}`` (``sere_fx.plan``); every front-end picks the range per call."""

    ranges: tuple = ()

    policy: ClassVar[str] = "ranges"

    def __init__(self, ranges):  # ``RowRanges(((1, SereConfig()), (64, OFF)))``: the ranges by position
        object.__setattr__(self, "ranges", ranges)
        self.__post_init__()

    def __post_init__(self):
        ranges = self.ranges
        if not isinstance(ranges, (tuple, list)) or not ranges:
            raise argument_error("ranges", f"ranges: expected a non-empty sequence of (min_rows, config), got {ranges!r}")
        out, last = [], 0
        for item in ranges:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise argument_error("ranges", f"ranges: expected (min_rows, config) pairs, got {item!r}")
            low, cfg = item
            if isinstance(low, bool) or not isinstance(low, int) or low <= last:
                want = "1" if last == 0 else f"an int > {last} (ascending)"
                raise argument_error("ranges", f"ranges: expected min_rows {want}, got {low!r}")
            if last == 0 and low != 1:
                raise argument_error("ranges", f"ranges: the first range must start at min_rows 1 (every call has a "
                                               f"setting), got {low}")
            if not isinstance(cfg, RoutingConfig) or isinstance(cfg, RowRanges):
                raise argument_error("ranges", f"ranges[{low}]: expected a RoutingConfig (SereConfig, OFF, ...), got "
                                               f"{type(cfg).__name__}", TypeError)
            out.append((low, cfg))
            last = low
        object.__setattr__(self, "ranges", tuple(out))
        object.__setattr__(self, "S", min((c.S for _, c in out if not isinstance(c, OffConfig)), default=1))

    @property
    def bounds(self) -> tuple[int, ...]:
        return tuple(low for low, _ in self.ranges)

    @property
    def configs(self) -> tuple[RoutingConfig, ...]:
        return tuple(c for _, c in self.ranges)

    def select(self, rows: int) -> RoutingConfig:
        """The config of a call with ``rows`` rows (``range_index``)."""
        return self.ranges[range_index(self.bounds, rows)][1]

    @property
    def needs_similarity(self) -> bool:
        return any(c.needs_similarity for _, c in self.ranges)

    @property
    def needs_predictor(self) -> bool:
        return any(c.needs_predictor for _, c in self.ranges)

    @property
    def needs_cache(self) -> bool:
        return any(c.needs_cache for _, c in self.ranges)

    @property
    def rho(self):  # one range's value is not the layer's; messages read the ranges
        return None

    def for_layer(self, layer, matrix=None):
        out = []
        for low, cfg in self.ranges:
            try:
                out.append((low, cfg.for_layer(layer, matrix)))
            except ArgumentError as exc:
                raise exc.renamed(exc.arg, suffix=f" (rows >= {low})") from None
        return RowRanges(tuple(out))

    def as_dict(self) -> dict:
        return {"policy": "ranges", "ranges": [{"min_rows": low, **c.as_dict()} for low, c in self.ranges]}


BUDGET_POLICIES = ("weight", "output")  # take N, min_importance and a per-rank budget


def _check_budget(name: str, value, unit: str, of: str) -> None:
    """An expert budget: a count (an int >= 1) or a fraction in (0, 1) of ``of``; None: none."""
    count = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    fraction = isinstance(value, float) and 0 < value < 1
    if value is not None and not (count or fraction):
        raise argument_error(name, f"{name}: expected a positive int ({unit}), a float in (0, 1) (a fraction "
                                   f"of {of}) or None, got {value!r}")


CONFIGS: dict[str, type[RoutingConfig]] = {
    c.policy: c for c in (SereConfig, LeastSimilarConfig, RandomConfig, TopKConfig, OEAConfig, WeightConfig,
                          OutputConfig, PriorConfig)
}
POLICIES = tuple(CONFIGS)
INDEX_POLICIES = tuple(p for p, c in CONFIGS.items() if c.needs_similarity)  # take rho, read a similarity
DEFAULT_POLICY = "sere"  # of the keyword spelling, when no policy is named


def config(policy: str | None = None, S: int | None = None, rho=None, N=None, *, rank_budget=None,
           placement=None) -> RoutingConfig:
    """One layer's config from the keyword spelling; None is "not given" (the config's default).

    ``rho`` is the similarity threshold of the index policies and ``weight``'s ``min_importance``;
    errors say the keyword (``rho``), not the field. ``rank_budget`` / ``placement``: ``weight``'s
    per-rank budget (plan files, ``eval``'s ``Nrank=``).
    """
    policy = DEFAULT_POLICY if policy is None else policy
    if policy not in CONFIGS:
        raise argument_error("policy", f"policy: expected one of {list(POLICIES)}, got {policy!r}")
    cls = CONFIGS[policy]
    kwargs = {} if S is None else {"S": S}
    if issubclass(cls, WeightConfig):
        kwargs.update(N=N, min_importance=rho, rank_budget=rank_budget, placement=placement)
    else:
        if rank_budget is not None or placement is not None:
            raise argument_error("rank_budget", f"rank_budget: only policies {list(BUDGET_POLICIES)} take a per-rank "
                                                f"budget, got policy {policy!r}")
        if N is not None:
            raise argument_error("N", f"N: only policies {list(BUDGET_POLICIES)} take an expert budget (leave it None "
                                      f"for {policy!r}), got {N!r}")
        if cls.needs_similarity or cls.needs_cache:  # a similarity threshold, or the prior's strength
            if rho is not None:
                kwargs["rho"] = rho
        elif rho is not None:
            raise argument_error("rho", f"rho: policy {policy!r} does not use rho (leave it None), got {rho!r}")
    try:
        return cls(**kwargs)
    except ArgumentError as exc:
        if "min_importance" in exc.message:  # the field, said as its keyword
            arg = "rho" if exc.arg == "min_importance" else exc.arg
            raise exc.renamed(arg, words={"min_importance": "rho"}) from None
        raise


def from_dict(entry: Mapping, layer: int) -> RoutingConfig:
    """A plan-file entry (``RoutingConfig.as_dict``) of decoder layer ``layer`` as a config; errors
    name ``plan[layer]`` (a bad value also carries ``err.layer`` and the value's own ``err.detail``)."""
    where = f"plan[{layer}]"
    if entry.get("policy") == "off":
        if set(entry) != {"policy"}:
            raise argument_error("plan", f"{where}: policy 'off' takes no settings, got keys {sorted(entry)}")
        return OFF
    if entry.get("policy") == "ranges":  # RowRanges.as_dict: one layer's ranges
        ranges = entry.get("ranges")
        if set(entry) != {"policy", "ranges"} or not isinstance(ranges, list) or not all(
                isinstance(r, Mapping) and "min_rows" in r for r in ranges):
            raise argument_error("plan", f"{where}: expected {{'policy': 'ranges', 'ranges': [{{'min_rows': ..., "
                                         f"'policy': ...}}, ...]}}, got {dict(entry)!r}")
        return _row_ranges([(r["min_rows"], from_dict({k: v for k, v in r.items() if k != "min_rows"}, layer))
                            for r in ranges], where)
    if set(entry) - {"policy", "S", "rho", "N", "rank_budget", "placement"} or not {"policy", "S"} <= set(entry):
        raise argument_error("plan", f"{where}: expected keys policy, S, rho and N, got {sorted(entry)}")
    try:
        placement = entry.get("placement")
        return config(entry["policy"], entry["S"], entry.get("rho"), entry.get("N"),
                      rank_budget=entry.get("rank_budget"),
                      placement=None if placement is None else Placement(**placement))
    except ArgumentError as exc:
        err = argument_error("plan", f"{where}: {exc.message}", exc._kind())
        err.layer, err.detail = layer, exc.message  # for front-ends that say where the plan file is
        raise err from None


_KEYWORDS = ("policy", "S", "rho", "N")


@dataclass(frozen=True)
class Keywords:
    """The keyword spelling: each of ``policy``, ``S``, ``rho``, ``N`` one value for every MoE layer or
    ``{decoder_layer_index: value}``; None: not given."""

    policy: object = None
    S: object = None
    rho: object = None
    N: object = None

    @property
    def given(self) -> list[str]:
        return [name for name in _KEYWORDS if getattr(self, name) is not None]

    @property
    def policies(self) -> set[str]:
        p = self.policy
        return set(p.values()) if isinstance(p, Mapping) else {DEFAULT_POLICY if p is None else p}

    def _at(self, key, layer=None):
        """One layer's config; errors name the argument with ``[key]`` where it was a mapping. With
        ``layer``, an int S outside its top-k range is said against the layer."""
        values = {name: getattr(self, name) for name in _KEYWORDS}
        picked = {name: v.get(key) if isinstance(v, Mapping) else v for name, v in values.items()}
        try:
            s = picked["S"]
            if layer is not None and isinstance(s, int) and not isinstance(s, bool):
                _check_top_k(s, layer)
            return config(**picked)
        except ArgumentError as exc:
            if isinstance(values.get(exc.arg), Mapping):
                raise exc.renamed(exc.arg, suffix=f"[{key}]") from None
            raise

    def check(self) -> None:
        """The model-independent checks, for every layer a mapping names (the model's own layers are
        checked by ``plan_for_layers``)."""
        keys = sorted({k for name in _KEYWORDS if isinstance(v := getattr(self, name), Mapping) for k in v})
        for key in keys or [None]:
            if any(isinstance(v := getattr(self, name), Mapping) and key not in v for name in ("policy", "S")):
                continue  # a layer a mapping leaves out: plan_for_layers names it against the model
            self._at(key)

    def for_layers(self, layers) -> dict:
        """``{layer: config}`` for ``layers``; a mapping must name exactly their indices."""
        want = [layer.index for layer in layers]
        for name in _KEYWORDS:
            value = getattr(self, name)
            if isinstance(value, Mapping) and sorted(value) != want:
                raise argument_error(name, f"{name}: expected values for the MoE decoder layers {want}, "
                                           f"got layers {sorted(value)}")
        return {layer.index: self._at(layer.index, layer) for layer in layers}


def routing_spec(config=None, *, policy=None, S=None, rho=None, N=None, plan=None, check: bool = True):
    """What a caller asked for, in one of three spellings, checked as far as no model is needed.

    ``config``: a ``RoutingConfig`` or ``{layer: RoutingConfig}`` (an int: ``S`` given by position,
    as in ``transform(model, sim, 2, 0.5)``); ``plan``: a plan (anything
    ``sere_fx.plan.load_plan`` reads); else the keywords. Spellings do not mix: a keyword given
    beside a config or a plan would be overridden, so it is an error. Returns a ``RoutingConfig``,
    ``{layer: RoutingConfig}`` or ``Keywords``. ``check=False`` leaves the keywords' values to
    ``plan_for_layers`` (a caller that has the model says S against each layer's top-k).
    """
    if isinstance(config, int) and not isinstance(config, bool):  # transform(model, sim, 2, 0.5): S by position
        if S is not None:
            raise argument_error("S", f"S: given by position ({config}) and by name ({S!r}); give it once")
        config, S = None, config
    keywords = Keywords(policy, S, rho, N)
    for other, name in ((config, "config"), (plan, "plan")):
        if other is not None and keywords.given:
            given = keywords.given[0]
            what = "a plan sets it per layer" if name == "plan" else "the config sets it"
            raise argument_error(given, f"{given}: {what}; got {given}={getattr(keywords, given)!r} as well")
    if config is not None and plan is not None:
        raise argument_error("plan", "plan: give a config or a plan, not both; got both")
    if plan is not None:
        return load_plan(plan)
    if config is None:
        config = keywords
    if isinstance(config, (RoutingConfig, Keywords)):
        if isinstance(config, Keywords) and check:
            config.check()
        return config
    if isinstance(config, Mapping):
        for k, v in config.items():
            if isinstance(k, bool) or not isinstance(k, int):
                raise argument_error("config", f"config: expected decoder-layer indices (int) as keys, got {k!r}",
                                     TypeError)
            if not isinstance(v, RoutingConfig):
                raise argument_error("config", f"config[{k}]: expected a RoutingConfig (SereConfig, OEAConfig, ...), "
                                               f"got {type(v).__name__}", TypeError)
        return dict(config)
    raise argument_error("config", "config: expected a RoutingConfig (SereConfig, OEAConfig, ...) or "
                                   f"{{layer: RoutingConfig}}, got {type(config).__name__}", TypeError)


def spec_policies(spec) -> set[str]:
    """Every policy a spec (``routing_spec``'s result) gives some layer."""
    if isinstance(spec, Keywords):
        return spec.policies
    configs = [spec] if isinstance(spec, RoutingConfig) else list(spec.values())
    return {c.policy for config in configs for c in (config.configs if isinstance(config, RowRanges) else [config])}


def calibration_need(spec) -> tuple[str, str] | None:
    """What ``spec`` needs from the calibration file (``sim``), for an error: ``(policy, "needs
    expert-similarity matrices")``, or None when it needs nothing."""
    for p in sorted(spec_policies(spec)):
        cls = CONFIGS.get(p)
        if cls is not None and cls.needs_similarity:
            return p, "needs expert-similarity matrices"
    for p in sorted(spec_policies(spec)):
        cls = CONFIGS.get(p)
        if cls is not None and cls.needs_predictor:
            return p, "needs the output-size predictors of a similarity file (sere-fx calibrate writes them)"
    return None


def cache_policy(spec) -> str | None:
    """A policy of ``spec`` that reads an offload cache's resident set (``prior``), or None: what front-ends
    that cannot carry an offloaded model refuse."""
    return next((p for p in sorted(spec_policies(spec)) if p in CONFIGS and CONFIGS[p].needs_cache), None)


def needs_similarity(spec) -> bool:
    """Whether some layer's policy reads the calibration file (``sim``): an expert-similarity matrix
    (the index policies) or an output-size predictor (``output``)."""
    return calibration_need(spec) is not None


def restrict(spec, indices):
    """A spec cut to the layers ``indices`` (a pipeline stage's, a compiled graph's); per-layer
    values for other layers are dropped, one config for every layer stays as it is."""
    indices = set(indices)
    if isinstance(spec, Keywords):
        return Keywords(*({i: v for i, v in value.items() if i in indices} if isinstance(value, Mapping) else value
                          for value in (getattr(spec, name) for name in _KEYWORDS)))
    if isinstance(spec, RoutingConfig):
        return spec
    return {i: c for i, c in spec.items() if i in indices}


def plan_for_layers(spec, layers, matrices: Mapping[int, torch.Tensor] | None = None) -> dict[int, RoutingConfig]:
    """One config per MoE layer of ``layers`` (objects with ``index``, ``name``, ``num_experts``,
    ``top_k``), checked against each layer; ``matrices``: ``{layer: [E, E]}`` to resolve quantiles."""
    if isinstance(spec, Keywords):
        per_layer = spec.for_layers(layers)
        suffix = {name: isinstance(getattr(spec, name), Mapping) for name in _KEYWORDS}
    elif isinstance(spec, RoutingConfig):
        per_layer = {layer.index: spec for layer in layers}
        suffix = {}
    else:
        want = [layer.index for layer in layers]
        if sorted(spec) != want:
            raise argument_error("config", f"config: expected configs for the MoE decoder layers {want}, "
                                           f"got layers {sorted(spec)}")
        per_layer = dict(spec)
        suffix = dict.fromkeys(("S", "rho", "N", "min_importance"), True)
    out = {}
    for layer in layers:
        i = layer.index
        try:
            out[i] = per_layer[i].for_layer(layer, None if matrices is None else matrices.get(i))
        except ArgumentError as exc:
            if suffix.get(exc.arg):
                raise exc.renamed(exc.arg, suffix=f"[{i}]") from None
            raise
    return out


def load_plan(plan) -> dict[int, RoutingConfig]:
    """A plan from a JSON path, a dict as ``sere_fx.plan.save_plan`` writes it, or ``{layer: RoutingConfig}``;
    every entry checked (an error names ``plan[<layer>]``)."""
    path = None
    if isinstance(plan, (str, os.PathLike)):
        path = os.fspath(plan)
        if not os.path.isfile(path):
            raise argument_error("plan", f"plan: no plan file at {path!r}", FileNotFoundError)
        try:
            with open(path) as f:
                plan = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise argument_error("plan", f"plan: {path!r} is not a plan file (JSON from `sere-fx tune`): {exc}") from None
    if isinstance(plan, Mapping) and "ranges" in plan:
        return _ranged_plan(plan["ranges"])
    if isinstance(plan, Mapping) and "layers" in plan:
        plan = plan["layers"]
    if not isinstance(plan, Mapping):
        raise argument_error("plan", "plan: expected a path, a dict with 'layers' or {layer: RoutingConfig}, "
                                     f"got {type(plan).__name__}", TypeError)
    out = {}
    for k, v in plan.items():
        if not (isinstance(k, int) and not isinstance(k, bool)) and not (isinstance(k, str) and k.strip().isdigit()):
            raise argument_error("plan", f"plan: expected decoder-layer indices as keys, got {k!r}")
        if isinstance(v, Mapping):
            v = from_dict(v, int(k))
        if not isinstance(v, RoutingConfig):
            raise argument_error("plan", f"plan[{k}]: expected a RoutingConfig or a dict, got {type(v).__name__}",
                                 TypeError)
        out[int(k)] = v
    return out


def _row_ranges(ranges, where: str) -> RowRanges:
    try:
        return RowRanges(tuple(ranges))
    except ArgumentError as exc:
        raise argument_error("plan", f"{where}: {exc.message}", exc._kind()) from None


def _ranged_plan(ranges) -> dict[int, RowRanges]:
    """A plan file's ``"ranges"``: ``[{"min_rows": 1, "layers": {...} | "off"}, ...]`` as ``{layer: RowRanges}``.
    Every range names the same layers (``"off"``: every layer of the plan is off in that range)."""
    if not isinstance(ranges, list) or not ranges or not all(isinstance(r, Mapping) for r in ranges):
        raise argument_error("plan", f"plan['ranges']: expected a non-empty list of {{'min_rows', 'layers'}}, got {ranges!r}")
    per_range = []
    for r in ranges:
        if set(r) != {"min_rows", "layers"}:
            raise argument_error("plan", f"plan['ranges']: expected each range to have keys min_rows and layers, got "
                                         f"{sorted(r)}")
        layers = r["layers"]
        per_range.append((r["min_rows"], None if layers == "off" else load_plan(layers)))
    named = [set(p) for _, p in per_range if p is not None]
    if not named:
        raise argument_error("plan", "plan['ranges']: every range is 'off'; name the layers of at least one range")
    indices = named[0]
    for (low, p) in per_range:
        if p is not None and set(p) != indices:
            raise argument_error("plan", f"plan['ranges']: the range at min_rows {low} names layers {sorted(p)}, "
                                         f"expected {sorted(indices)} as the others")
    return {i: _row_ranges([(low, OFF if p is None else p[i]) for low, p in per_range], f"plan[{i}]")
            for i in sorted(indices)}
