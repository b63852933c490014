"""Timing helpers shared by the benchmarks and the demo.

A figure is always a median over repeats with its spread, measured against the baseline in
the same run, next to the limit that physics allows (distinct experts read).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    repeats: int

    @classmethod
    def of(cls, samples: list[float]) -> "Timing":
        s = sorted(samples)
        pick = lambda q: s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]  # noqa: E731
        return cls(statistics.median(s), pick(0.1), pick(0.9), len(s))

    def fmt(self, unit: float = 1e3, suffix: str = "ms") -> str:
        return f"{self.median_s * unit:.2f} {suffix} [{self.p10_s * unit:.2f}, {self.p90_s * unit:.2f}]"


def time_fn(fn, repeats: int = 10, warmup: int = 2) -> Timing:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return Timing.of(samples)


@torch.no_grad()
def decode_step_timing(model: nn.Module, batch: torch.Tensor, *, context: int = 16, steps: int = 16,
                       repeats: int = 5) -> Timing:
    """Time per single-token decode step of ``batch`` (``[B, >= context + steps]``) with a KV cache.

    Each repeat prefills ``context`` tokens (bypassing re-routing, untimed) and times
    ``steps`` decode steps; the figure is per step.
    """
    from sere_fx.evaluate import CachedDecode

    if batch.shape[1] < context + steps:
        raise ValueError(f"batch: expected at least context + steps = {context + steps} tokens per sequence, "
                         f"got {batch.shape[1]}")
    decoder = CachedDecode(model)

    def one() -> float:
        decoder.prefill(batch[:, :context])
        start = time.perf_counter()
        for t in range(context, context + steps):
            decoder.step(batch[:, t : t + 1])
        return (time.perf_counter() - start) / steps

    one()  # warm-up
    return Timing.of([one() for _ in range(repeats)])
