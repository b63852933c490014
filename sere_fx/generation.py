"""Free-running evaluation: what a routing policy does to the text a model generates.

``sere-fx eval`` scores teacher-forced next-token predictions: cheap and precise, but not what a
user reads. Here each window's first ``prefill`` tokens are a prompt, prefilled with the model's
own routing (``sere_fx.bypass``), and B sequences then decode greedily in lockstep with a KV
cache, each step feeding back the token it chose, so every MoE layer sees exactly the B tokens
of a real decode batch (the same protocol as ``evaluate``, without the teacher). Per sequence:

- **agreement**: the tokens the policy generated that equal the baseline's before their first
  difference (greedy decoding diverges for good at the first different token);
- **edit similarity to the baseline**: 1 - Levenshtein distance / length, over tokens, between
  the policy's continuation and the baseline's (how much of the text survives a divergence);
- **edit similarity to the reference**: the same against the text that followed the prompt in
  the data (the baseline has one too, so a policy is compared with the baseline on it).

Intervals are 95% paired bootstraps over sequences (the same resamples for every policy), as
``evaluate``'s. Small models repeat themselves once free-running, so these measures are noisy;
the intervals say how noisy.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from sere_fx.config import needs_similarity
from sere_fx.errors import ArgumentValueError
from sere_fx.evaluate import CachedDecode, ExpertCounter, check_decode_args, checked_policies
from sere_fx.model_transform import restore, transform


def edit_similarity(a, b) -> float:
    """1 - Levenshtein distance / max length of two token sequences (1 for two empty ones).

    One row of the dynamic programme at a time, vectorised: a row's insertions are a running
    minimum of (substitution or deletion cost - position) + position."""
    a, b = np.asarray(a), np.asarray(b)
    if len(a) == 0 or len(b) == 0:
        return 1.0 if len(a) == len(b) else 0.0
    positions = np.arange(len(b) + 1)
    row = positions.copy()
    for i in range(1, len(a) + 1):
        best = np.empty_like(row)
        best[0] = i
        best[1:] = np.minimum(row[1:] + 1, row[:-1] + (b != a[i - 1]))  # deletion, substitution
        row = np.minimum.accumulate(best - positions) + positions  # insertions, left to right
    return 1.0 - row[-1] / max(len(a), len(b))


def agreement(a, b) -> int:
    """Tokens of ``a`` equal to ``b``'s before their first difference."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    differ = np.nonzero(a[:n] != b[:n])[0]
    return int(differ[0]) if len(differ) else n


@torch.no_grad()
def generate_batched(model: nn.Module, windows: torch.Tensor, *, batch_size: int = 32, prefill: int = 4,
                     steps: int | None = None, progress: bool = True, desc: str = "generate"):
    """Greedy batched decode from ``windows[:, :prefill]``: ``(tokens [N, steps], distinct experts per
    MoE layer per decode step)``. ``steps`` defaults to the rest of the window."""
    n, length = windows.shape
    steps = length - prefill if steps is None else steps
    check_decode_args(windows, batch_size, prefill, after=0)
    if not isinstance(steps, int) or steps < 1:
        raise ArgumentValueError("steps", f"steps: expected a positive int, got {steps!r}")
    counter = ExpertCounter(model)
    device = next(model.parameters()).device
    decoder = CachedDecode(model)
    out = torch.empty(n, steps, dtype=torch.long)
    bar = tqdm(total=math.ceil(n / batch_size) * steps, desc=desc, unit="step", leave=False, disable=not progress)
    try:
        for start in range(0, n, batch_size):
            batch = windows[start : start + batch_size].to(device)
            counter.decoding = False
            token = decoder.prefill(batch[:, :prefill]).argmax(-1, keepdim=True)  # the model's own routing
            out[start : start + batch.shape[0], 0] = token[:, 0].cpu()
            counter.decoding = True
            for t in range(1, steps):
                token = decoder.step(token).argmax(-1, keepdim=True)
                out[start : start + batch.shape[0], t] = token[:, 0].cpu()
                bar.update(1)
            bar.update(1)
    finally:
        counter.remove()
        bar.close()
    return out, counter.distinct()


MEASURES = {  # field: what the table's column says
    "agreement": "tokens equal to the baseline's before the first difference",
    "sim_baseline": "edit similarity to the baseline's continuation",
    "sim_reference": "edit similarity to the reference text",
}


@dataclass
class GenerationResult:
    label: str
    agreement: float
    agreement_ci: list
    sim_baseline: float
    sim_baseline_ci: list
    sim_reference: float
    sim_reference_ci: list
    dsim_reference: float  # minus the baseline's, paired
    dsim_reference_ci: list
    distinct: float
    distinct_per_layer: dict
    settings: dict | None = None


@dataclass
class GenerationReport:
    results: list[GenerationResult]
    config: dict = field(default_factory=dict)
    tokens: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # generated, by label

    def table(self) -> str:
        lines = [f"{'policy':<28} {'agree':>7} {'[95% CI]':>16} {'sim base':>9} {'[95% CI]':>16} "
                 f"{'sim ref':>8} {'d vs base [95% CI]':>26} {'experts/layer':>14}"]
        for r in self.results:
            lines.append(
                f"{r.label:<28} {r.agreement:>7.2f} [{r.agreement_ci[0]:6.2f}, {r.agreement_ci[1]:6.2f}]"
                f" {r.sim_baseline:>9.4f} [{r.sim_baseline_ci[0]:.4f}, {r.sim_baseline_ci[1]:.4f}]"
                f" {r.sim_reference:>8.4f} {r.dsim_reference:>+8.4f} [{r.dsim_reference_ci[0]:+.4f}, "
                f"{r.dsim_reference_ci[1]:+.4f}] {r.distinct:>14.1f}")
        steps = self.config.get("steps")
        lines.append(f"(free-running greedy decode, {steps} tokens per sequence; agree: {MEASURES['agreement']}; "
                     f"sim base: {MEASURES['sim_baseline']}; sim ref: {MEASURES['sim_reference']}, and its "
                     "difference to the baseline's; intervals: paired bootstrap over sequences, 95%)")
        return "\n".join(lines)

    def save(self, out_dir: str | os.PathLike) -> str:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "generate.json")
        with open(path, "w") as f:
            json.dump({"config": self.config, "measures": MEASURES, "results": [asdict(r) for r in self.results]},
                      f, indent=1)
        return path


def mean_interval(values: np.ndarray, resamples: int = 2000, seed: int = 0) -> list:
    """95% interval of the mean of ``values [N]`` over sequences (the same resamples for every
    measure and policy: the generator is seeded alike)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, values.shape[0], size=(resamples, values.shape[0]))
    means = values[idx].mean(axis=1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def generation_report(generated: list, reference: np.ndarray, config: dict) -> GenerationReport:
    """``generated``: ``[(label, tokens [N, steps], distinct per layer, settings)]``, the baseline first."""
    base = generated[0][1]
    base_ref = np.array([edit_similarity(b, r) for b, r in zip(base, reference)])
    results = []
    for label, tokens, distinct, settings in generated:
        agree = np.array([agreement(t, b) for t, b in zip(tokens, base)], dtype=np.float64)
        sim_base = np.array([edit_similarity(t, b) for t, b in zip(tokens, base)])
        sim_ref = np.array([edit_similarity(t, r) for t, r in zip(tokens, reference)])
        results.append(GenerationResult(
            label=label, agreement=float(agree.mean()), agreement_ci=mean_interval(agree),
            sim_baseline=float(sim_base.mean()), sim_baseline_ci=mean_interval(sim_base),
            sim_reference=float(sim_ref.mean()), sim_reference_ci=mean_interval(sim_ref),
            dsim_reference=float((sim_ref - base_ref).mean()), dsim_reference_ci=mean_interval(sim_ref - base_ref),
            distinct=float(np.mean(list(distinct.values()))), distinct_per_layer={str(k): v for k, v in distinct.items()},
            settings=settings))
    return GenerationReport(results, config, {label: tokens.numpy() for label, tokens, _, _ in generated})


def evaluate_generation(model: nn.Module, windows: torch.Tensor, policies, sim=None, *, batch_size: int = 32,
                        prefill: int = 4, max_tokens: int | None = None, progress: bool = True) -> GenerationReport:
    """Free-running batched greedy decode of ``policies`` (as ``evaluate`` takes them) from the same
    prompts ``windows[:, :prefill]``; the rest of each window is the reference. The first result
    is the untransformed baseline."""
    specs, routings, sim = checked_policies(model, policies, sim)
    n = int(windows.shape[0])
    if not isinstance(batch_size, int) or not 1 <= batch_size <= n:
        raise ArgumentValueError("batch_size", f"batch_size: expected an int in [1, {n}] (the number of sequences), "
                                               f"got {batch_size!r}: every decode step must carry a full batch")
    dropped = n % batch_size
    windows = windows[: n - dropped]
    kw = dict(batch_size=batch_size, prefill=prefill, progress=progress)
    generated = [("baseline", *generate_batched(model, windows, desc="baseline", **kw), None)]
    for spec in specs:
        routing = routings[spec.label]
        transform(model, sim if needs_similarity(routing) else None, routing, max_tokens=max_tokens)
        try:
            settings = model.sere_settings.as_dict()
            generated.append((spec.label, *generate_batched(model, windows, desc=spec.label, **kw), settings))
        finally:
            restore(model)
    reference = windows[:, prefill:].numpy()
    config = {"batch_size": batch_size, "prefill": prefill, "sequences": int(windows.shape[0]),
              "dropped_sequences": dropped, "steps": int(windows.shape[1] - prefill), "max_tokens": max_tokens}
    return generation_report(generated, reference, config)
