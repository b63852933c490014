"""Timing helpers shared by the benchmarks and the demo.

A figure is always a median over repeats with its spread, measured against the baseline in
the same run, next to the limit that physics allows (distinct experts read).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from sere_fx.errors import ArgumentValueError


@dataclass
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    repeats: int

    @classmethod
    def of(cls, samples) -> "Timing":
        p10, median, p90 = np.percentile(np.asarray(samples, dtype=np.float64), [10, 50, 90])
        return cls(float(median), float(p10), float(p90), len(samples))

    def fmt(self, unit: float = 1e3, suffix: str = "ms") -> str:
        return f"{self.median_s * unit:.2f} {suffix} [{self.p10_s * unit:.2f}, {self.p90_s * unit:.2f}]"


def seconds(fn: Callable[[], object], number: int = 1) -> float:
    """Seconds per call of ``fn``, over ``number`` back-to-back calls. The clock is
    ``torch.utils.benchmark.timer``: it synchronises the accelerator (if any) when read, so queued
    GPU work is inside the timed region."""
    from torch.utils.benchmark import timer

    start = timer()
    for _ in range(number):
        fn()
    return (timer() - start) / number


def time_fn(fn: Callable[[], object], repeats: int = 10, warmup: int = 2, number: int = 1,
            device: str | torch.device | None = None) -> Timing:
    """Median and spread over ``repeats`` samples of ``number`` calls each, after ``warmup`` calls.
    On a CUDA ``device`` the samples come from ``triton.testing.do_bench`` (CUDA events, cache
    flushed between calls)."""
    if device is not None and torch.device(device).type == "cuda":
        from triton.testing import do_bench

        ms = do_bench(fn, warmup=max(warmup, 1), rep=max(repeats, 1), return_mode="all")
        return Timing.of([m / 1e3 for m in ms])
    for _ in range(warmup):
        fn()
    return Timing.of([seconds(fn, number) for _ in range(repeats)])


def time_paired(fns: Mapping[str, Callable[[], float | None]], repeats: int, warmup: int = 1,
                number: int = 1) -> dict[str, list[float]]:
    """Samples of several callables timed in the same run, interleaved: the order rotates every
    repeat, so drift of the machine falls on every side alike. A callable that returns a float
    reports its own seconds (it times a part of what it runs); else the call is timed."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names[i % len(names):] + names[: i % len(names)]:
            own = []
            took = seconds(lambda: own.append(fns[name]()), number)
            samples[name].append(own[0] if isinstance(own[0], float) else took)
    return samples


def _step_timer(model: nn.Module, batch: torch.Tensor, context: int, steps: int):
    """A callable that prefills ``context`` tokens (bypassing re-routing, untimed) and returns the
    seconds per decode step over the next ``steps`` tokens of ``batch``."""
    from sere_fx.evaluate import CachedDecode

    if batch.shape[1] < context + steps:
        raise ArgumentValueError("batch", f"batch: expected at least context + steps = {context + steps} tokens per "
                                          f"sequence, got {batch.shape[1]}")
    decoder = CachedDecode(model)

    def decode():
        for t in range(context, context + steps):
            decoder.step(batch[:, t : t + 1])

    def one() -> float:
        decoder.prefill(batch[:, :context])
        return seconds(decode) / steps

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

    samples = time_paired({"baseline": baseline, "policy": one}, repeats)
    base, pol = samples["baseline"], samples["policy"]
    return PairedTiming(Timing.of(base), Timing.of(pol), Timing.of([b / p for b, p in zip(base, pol)]))
