"""Expert-similarity matrices: the container ``transform`` consumes and calibration produces.

A ``Similarity`` maps a decoder-layer index to a float ``[E, E]`` matrix (1 on the
diagonal, larger = more alike) plus free-form metadata (method, model identity, ...), and,
when calibration could see the router's scores, each layer's *output-size predictor*
(``[E + 1, E]``, read by the ``output`` policy: ``sere_fx.policies``).
Files are safetensors: one tensor ``layer.<i>`` per MoE layer, ``predictor.<i>`` for the
predictors, and the metadata as JSON.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import torch

from sere_fx.errors import ArgumentFileNotFoundError, ArgumentTypeError, ArgumentValueError

_META_KEY = "sere_fx"


class Similarity(Mapping):
    """``{decoder_layer_index: Tensor[E, E]}`` with metadata; ``save``/``load`` round-trip."""

    def __init__(self, matrices: Mapping[int, torch.Tensor], metadata: Mapping | None = None,
                 predictors: Mapping[int, torch.Tensor] | None = None):
        self._matrices = {int(k): v for k, v in sorted(matrices.items())}
        self.metadata = dict(metadata or {})
        self.predictors = {int(k): v for k, v in sorted((predictors or {}).items())}

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self._matrices[layer]

    def __iter__(self):
        return iter(self._matrices)

    def __len__(self) -> int:
        return len(self._matrices)

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self._matrices.items()}
        return f"Similarity(layers={shapes}, predictors={sorted(self.predictors)}, metadata={self.metadata})"

    def save(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save

        tensors = {f"{prefix}.{k}": v.detach().to("cpu", torch.float32).contiguous()
                   for prefix, group in (("layer", self._matrices), ("predictor", self.predictors))
                   for k, v in group.items()}
        data = save(tensors, metadata={_META_KEY: json.dumps(self.metadata, sort_keys=True)})
        # written with open(), so the file gets the user's umask like every other output (safetensors'
        # save_file makes it 0600, which a server running as another user cannot read)
        with open(os.fspath(path), "wb") as f:
            f.write(data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Similarity":
        from safetensors import safe_open

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ArgumentFileNotFoundError("sim", f"sim: no similarity file at {path!r}")
        groups = {"layer": {}, "predictor": {}}
        with safe_open(path, framework="pt") as f:
            raw = (f.metadata() or {}).get(_META_KEY)
            metadata = json.loads(raw) if raw else {}
            for key in f.keys():
                prefix, _, index = key.partition(".")
                if prefix not in groups or not index.isdigit():
                    raise ArgumentValueError("sim", f"sim: {path!r} has tensor {key!r}; expected keys 'layer.<decoder "
                                                    "layer index>' and 'predictor.<decoder layer index>'")
                groups[prefix][int(index)] = f.get_tensor(key)
        return cls(groups["layer"], metadata, groups["predictor"])


def as_similarity(sim) -> Similarity:
    """Accept a ``Similarity``, a path, a ``{layer: Tensor}`` mapping or a sequence in MoE-layer order.

    A sequence becomes a mapping keyed by *position* (-1 - i), resolved against the model's
    MoE layers by ``resolve``.
    """
    if isinstance(sim, Similarity):
        return sim
    if isinstance(sim, (str, os.PathLike)):
        return Similarity.load(sim)
    if isinstance(sim, Mapping):
        for k, v in sim.items():
            if not isinstance(k, int) or isinstance(k, bool):
                raise ArgumentTypeError("sim", f"sim: mapping keys must be decoder-layer indices (int), got {k!r}")
            if not isinstance(v, torch.Tensor):
                raise ArgumentTypeError("sim", f"sim[{k}]: expected a torch.Tensor, got {type(v).__name__}")
        return Similarity(sim)
    if isinstance(sim, Sequence) and not isinstance(sim, (bytes, str)):
        for i, v in enumerate(sim):
            if not isinstance(v, torch.Tensor):
                raise ArgumentTypeError("sim", f"sim[{i}]: expected a torch.Tensor, got {type(v).__name__}")
        seq = Similarity({i: v for i, v in enumerate(sim)}, {"_in_moe_order": True})
        return seq
    raise ArgumentTypeError(
        "sim",
        "sim: expected a Similarity, a path to a saved similarity file, a mapping "
        f"{{decoder_layer_index: Tensor[E, E]}} or a sequence of [E, E] tensors; got {type(sim).__name__}"
    )


def resolve(sim, layers: Sequence) -> dict[int, torch.Tensor]:
    """Match ``sim`` to the model's MoE layers (objects with ``index``, ``name``, ``num_experts``).

    Returns ``{decoder_layer_index: float32 [E, E]}``; every mismatch raises naming the
    argument, the expected and the actual value.
    """
    sim = as_similarity(sim)
    indices = [layer.index for layer in layers]
    if sim.metadata.get("_in_moe_order"):
        if len(sim) != len(layers):
            raise ArgumentValueError(
                "sim",
                f"sim: expected {len(layers)} matrices (one per MoE layer, decoder layers {indices}), got {len(sim)}"
            )
        matrices = {layer.index: sim[i] for i, layer in enumerate(layers)}
    else:
        if sorted(sim) != sorted(indices):
            raise ArgumentValueError(
                "sim",
                f"sim: expected matrices for the MoE decoder layers {indices}, got layers {sorted(sim)}"
            )
        matrices = {layer.index: sim[layer.index] for layer in layers}
    out = {}
    for layer in layers:
        m = matrices[layer.index]
        e = layer.num_experts
        if tuple(m.shape) != (e, e):
            raise ArgumentValueError(
                "sim",
                f"sim[{layer.index}]: expected shape [{e}, {e}] (experts of {layer.name}), got {list(m.shape)}"
            )
        if not m.dtype.is_floating_point:
            raise ArgumentTypeError("sim", f"sim[{layer.index}]: expected a floating-point tensor, got {m.dtype}")
        check_finite(f"sim[{layer.index}]", m)
        out[layer.index] = m.detach().to(torch.float32).clone()
    return out


def non_finite(matrix: torch.Tensor) -> tuple[int, float, list[int]] | None:
    """``(count, first value, its [row, col])`` of a matrix's non-finite entries, or None when all are
    finite (a NaN similarity would make every comparison with rho false)."""
    finite = torch.isfinite(matrix)
    if bool(finite.all()):
        return None
    bad = (~finite).nonzero()[0].tolist()
    return int((~finite).sum()), matrix[bad[0], bad[1]].item(), bad


def check_finite(name: str, matrix: torch.Tensor) -> None:
    if (found := non_finite(matrix)) is not None:
        count, value, where = found
        raise ArgumentValueError(name.split("[")[0], f"{name}: expected finite values, got {value} at {where} "
                                                     f"({count} non-finite entries)")


def resolve_predictors(sim, layers: Sequence, policy: str = "output") -> dict[int, torch.Tensor]:
    """``{decoder_layer_index: float32 [E + 1, E]}``: the output-size predictors of ``layers`` in ``sim``
    (a file ``sere-fx calibrate`` wrote); a layer without one, or one of another shape, raises."""
    sim = as_similarity(sim)
    out = {}
    for layer in layers:
        p = sim.predictors.get(layer.index)
        e = layer.num_experts
        if p is None:
            raise ArgumentValueError("sim", f"sim: policy {policy!r} needs an output-size predictor for layer "
                                            f"{layer.index}; this similarity file has "
                                            f"{'none' if not sim.predictors else f'them for layers {sorted(sim.predictors)}'} "
                                            "(sere-fx calibrate writes them)")
        if tuple(p.shape) != (e + 1, e):
            raise ArgumentValueError("sim", f"sim.predictors[{layer.index}]: expected shape [{e + 1}, {e}] (experts of "
                                            f"{layer.name}, plus a constant), got {list(p.shape)}")
        check_finite(f"sim.predictors[{layer.index}]", p)
        out[layer.index] = p.detach().to(torch.float32).clone()
    return out


def layer_tensors(sim, layers: Sequence, plans: Mapping, matrices: Mapping[int, torch.Tensor] | None
                  ) -> dict[int, torch.Tensor]:
    """The calibrated tensor each layer's policy reads (``plans``: ``{layer: RoutingConfig}``): its
    similarity matrix (index policies), its output-size predictor (``output``), or nothing. One
    place for every front-end, so a policy reads the same tensor wherever it runs."""
    out = layer_predictors(sim, layers, plans)
    for layer in layers:
        if plans[layer.index].needs_similarity:
            out[layer.index] = matrices[layer.index]
    return out


def layer_predictors(sim, layers: Sequence, plans: Mapping) -> dict[int, torch.Tensor]:
    """The output-size predictor of each layer whose settings read one (``output``, in some range)."""
    wanting = [layer for layer in layers if plans[layer.index].needs_predictor]
    if not wanting:
        return {}
    policy = plans[wanting[0].index].policy
    return resolve_predictors(sim, wanting, "output" if policy == "ranges" else policy)
