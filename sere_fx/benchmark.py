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


def _step_timer(model: nn.Module, batch: torch.Tensor, context: int, steps: int):
    """A callable that prefills ``context`` tokens (bypassing re-routing, untimed) and returns the
    seconds per decode step over the next ``steps`` tokens of ``batch``."""
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

    return one


@dataclass
class PairedTiming:
    """Baseline and policy timed in the same run, interleaved; ``speedup`` is the distribution of
    the per-repeat ratios baseline/policy, so drift of the machine cancels within each pair."""

    baseline: Timing
    policy: Timing
    speedup: Timing

    def fmt_speedup(self) -> str:
        return f"{self.speedup.median_s:.2f}x [{self.speedup.p10_s:.2f}, {self.speedup.p90_s:.2f}]"


@torch.no_grad()
def paired_decode_timing(model: nn.Module, batch: torch.Tensor, *, repeats: int = 9, context: int = 16,
                         steps: int = 16) -> PairedTiming:
    """Decode-step timing of a transformed ``model``: its own routing (under ``sere_fx.bypass``)
    against its policy, alternating which side runs first in each repeat, after a warm-up of both.
    Each sample prefills ``context`` tokens (untimed) and times ``steps`` decode steps."""
    from sere_fx.policies import bypass

    one = _step_timer(model, batch, context, steps)

    def baseline() -> float:
        with bypass():
            return one()

    baseline(), one()  # warm-up
    base, pol = [], []
    for i in range(repeats):
        if i % 2 == 0:
            base.append(baseline())
            pol.append(one())
        else:
            pol.append(one())
            base.append(baseline())
    return PairedTiming(Timing.of(base), Timing.of(pol), Timing.of([b / p for b, p in zip(base, pol)]))
