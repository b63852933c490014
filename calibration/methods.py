"""Similarity methods, as streaming accumulators over calibration batches.

For one MoE layer, with X the hidden states entering the experts (real tokens only) and
``Y_e = expert_e(X)`` the raw output of expert e on all those tokens:

- ``frobenius``: d_ij = ||Y_i - Y_j||_F; sim = 1 - d / max(d); diag 1.
  From the Gram sums G_ij = sum_t <Y_i[t], Y_j[t]>: d_ij^2 = G_ii + G_jj - 2 G_ij.
- ``cosine``: c_ij = mean_t cos(Y_i[t], Y_j[t]); sim = (c + 1) / 2; diag 1.
  From the Gram sums of per-token unit vectors (a zero output vector counts as cosine 0).
- ``cka`` (linear): centre each Y_e over tokens; sim_ij = ||Y_j^T Y_i||_F^2 /
  (||Y_i^T Y_i||_F ||Y_j^T Y_j||_F), clamped to [0, 1]; diag 1. Computed as
  <K_i, K_j> / (||K_i|| ||K_j||) with K_e = Y_e Y_e^T over a bounded, uniformly drawn
  token sample (reservoir sampling), since it needs all sampled tokens at once.

Frobenius and cosine keep O(E^2) float64 state per layer whatever the token count.
"""

from __future__ import annotations

import torch

from sere_fx.errors import ArgumentValueError

METHODS = ("frobenius", "cosine", "cka")
DEFAULT_CKA_SAMPLE = 1024


DEFAULT_CHUNK_TOKENS = 2048  # tokens per expert-output evaluation ([E, chunk, H] at a time)


class _GramAccumulator:
    def __init__(self, expert_outputs, num_experts: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        self.outputs = expert_outputs
        self.gram = torch.zeros(num_experts, num_experts, dtype=torch.float64)
        self.tokens = 0
        self.chunk_tokens = chunk_tokens

    def _prepare(self, y: torch.Tensor) -> torch.Tensor:
        return y

    @torch.no_grad()
    def update(self, x: torch.Tensor, also=None) -> None:
        """``also(start, y)``: called with each chunk's raw outputs ``[E, chunk, H]`` (the predictor
        fit reads the same ones, so every expert runs once per token)."""
        for start in range(0, x.shape[0], self.chunk_tokens):
            raw = self.outputs(x[start : start + self.chunk_tokens])
            if also is not None:
                also(start, raw)
            y = self._prepare(raw.float())
            flat = y.reshape(y.shape[0], -1)
            self.gram += (flat @ flat.T).to("cpu", torch.float64)
        self.tokens += x.shape[0]


class Frobenius(_GramAccumulator):
    def finalize(self) -> torch.Tensor:
        g = self.gram
        diag = g.diagonal()
        d = (diag[:, None] + diag[None, :] - 2 * g).clamp_min(0).sqrt()
        d.fill_diagonal_(0)
        top = d.max()
        sim = torch.ones_like(d) if top == 0 else 1 - d / top
        return sim.fill_diagonal_(1).float()


class Cosine(_GramAccumulator):
    def _prepare(self, y):
        return y / y.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    def finalize(self) -> torch.Tensor:
        c = self.gram / max(self.tokens, 1)
        return ((c + 1) / 2).fill_diagonal_(1).float()


class CKA:
    def __init__(self, expert_outputs, num_experts: int, sample: int = DEFAULT_CKA_SAMPLE, seed: int = 0):
        self.outputs = expert_outputs
        self.num_experts = num_experts
        self.sample = sample
        self.rows: torch.Tensor | None = None
        self.tokens = 0
        self.gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def update(self, x: torch.Tensor, also=None) -> None:
        """``also(start, y)`` as for the Gram methods (CKA itself reads outputs only at the end)."""
        if also is not None:
            for start in range(0, x.shape[0], DEFAULT_CHUNK_TOKENS):
                also(start, self.outputs(x[start : start + DEFAULT_CHUNK_TOKENS]))
        x = x.detach()
        if self.rows is None:
            self.rows = x.new_empty(0, x.shape[1])
        room = self.sample - self.rows.shape[0]
        if room > 0:
            self.rows = torch.cat([self.rows, x[:room]])
        # Reservoir sampling (Algorithm R) for the rest: token n takes slot j ~ U{0..n} if j < sample.
        start = max(room, 0)
        if start < x.shape[0]:
            n = torch.arange(self.tokens + start, self.tokens + x.shape[0], dtype=torch.float64)
            j = (torch.rand(n.shape[0], generator=self.gen, dtype=torch.float64) * (n + 1)).long()
            for i in (j < self.sample).nonzero().flatten().tolist():  # in order: later tokens win
                self.rows[j[i]] = x[start + i]
        self.tokens += x.shape[0]

    @torch.no_grad()
    def finalize(self) -> torch.Tensor:
        y = self.outputs(self.rows).double()  # [E, N, H]
        y = y - y.mean(dim=1, keepdim=True)
        k = torch.matmul(y, y.transpose(1, 2)).reshape(self.num_experts, -1)  # K_e, flattened
        hsic = k @ k.T
        norm = hsic.diagonal().clamp_min(0).sqrt()
        denom = norm[:, None] * norm[None, :]
        sim = torch.where(denom > 0, hsic / denom.clamp_min(1e-300), torch.zeros_like(hsic))
        return sim.clamp(0, 1).fill_diagonal_(1).float()


def accumulator(method: str, expert_outputs, num_experts: int, cka_sample: int = DEFAULT_CKA_SAMPLE):
    if method == "frobenius":
        return Frobenius(expert_outputs, num_experts)
    if method == "cosine":
        return Cosine(expert_outputs, num_experts)
    if method == "cka":
        return CKA(expert_outputs, num_experts, cka_sample)
    raise ArgumentValueError("method", f"method: expected one of {list(METHODS)}, got {method!r}")
