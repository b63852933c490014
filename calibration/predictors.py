"""Output-size predictors for the ``output`` policy (``sere_fx.policies``).

Per MoE layer, a ridge least-squares fit of every expert's log squared output norm,
``log ||expert_e(x_t)||^2``, on the token's routing features (``output_features``: the
router's log-probabilities and a constant 1). The router already computes those features for
every token, so the policy can weigh what dropping an expert costs by the size of what the
expert would add without reading any expert weight. Streaming: the fit keeps the normal
equations (``[E + 1, E + 1]`` and ``[E + 1, E]``, float64), whatever the token count.

The features are read at the routing site itself (the router's traced graph cut at the
scores its top-k reads), so they are exactly what the policy sees when it runs.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from sere_fx.policies import output_features

# Ridge strength per token: the features are log-probabilities (a few units each), so a small
# multiple of the token count keeps the 65-unknown fit stable on a few thousand tokens without
# pulling it toward zero (the constant is not penalised).
DEFAULT_RIDGE = 1e-2


def score_function(layer) -> fx.GraphModule:
    """The router of ``layer`` (a ``discovery.MoELayer``) as a module that returns the scores its
    routing top-k reads (``[..., E]``), called with the router's own arguments."""
    graph = fx.Graph()
    values: dict = {}
    graph.graph_copy(layer.graph, values, return_output_node=False)
    graph.output(values[layer.site.scores])
    graph.eliminate_dead_code()
    for node in graph.nodes:
        node.meta.pop("val", None)
    return fx.GraphModule(layer.router, graph)


class PredictorFit:
    """Accumulates one layer's fit: ``update(features [T, E + 1], outputs [E, T, H])``, then ``finalize()``."""

    def __init__(self, num_experts: int, ridge: float = DEFAULT_RIDGE):
        self.num_experts = num_experts
        self.ridge = ridge
        self.xtx = torch.zeros(num_experts + 1, num_experts + 1, dtype=torch.float64)
        self.xty = torch.zeros(num_experts + 1, num_experts, dtype=torch.float64)
        self.tokens = 0

    @torch.no_grad()
    def update(self, features: torch.Tensor, outputs: torch.Tensor) -> None:
        f = features.to("cpu", torch.float64)
        # log of the squared norm; an all-zero output (a dead expert) counts as a tiny one
        target = outputs.float().square().sum(dim=-1).T.clamp_min(1e-30).log().to("cpu", torch.float64)  # [T, E]
        self.xtx += f.T @ f
        self.xty += f.T @ target
        self.tokens += f.shape[0]

    def finalize(self) -> torch.Tensor:
        """``[E + 1, E]`` float32: ``exp(features @ P)`` is each expert's predicted squared output norm."""
        penalty = torch.eye(self.num_experts + 1, dtype=torch.float64) * (self.ridge * max(self.tokens, 1))
        penalty[-1, -1] = 0.0  # the constant column is not shrunk
        return torch.linalg.solve(self.xtx + penalty, self.xty).float()


def features_hook(layer, store: dict, key: int):
    """A forward pre-hook (``with_kwargs=True``) for ``layer.router`` that puts the layer's routing
    features (``[T, E + 1]``) in ``store[key]``."""
    scores_of = score_function(layer)
    neutral = float("-inf") if layer.site.score_fn == "logits" else 0.0

    def hook(module: nn.Module, args, kwargs):
        with torch.no_grad():
            scores = scores_of(*args, **kwargs)
        store[key] = output_features(scores.reshape(-1, scores.shape[-1]), neutral)

    return hook
