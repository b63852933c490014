"""``inspect``: what a similarity file says, per layer, and heat maps of it."""

from __future__ import annotations

import math
import os

import torch

from sere_fx.similarity import Similarity


def layer_summary(matrix: torch.Tensor, rho: float) -> dict:
    """Off-diagonal mean/min/max, and how many experts are critical at ``rho``.

    An expert is counted critical when its best match among the *other* experts is below
    rho: whichever experts end up primary, it can never be re-routed (an upper bound on
    what ``sere`` keeps).
    """
    e = matrix.shape[0]
    off = matrix[~torch.eye(e, dtype=torch.bool)]
    best_other = matrix.masked_fill(torch.eye(e, dtype=torch.bool), float("-inf")).max(dim=1).values
    return {
        "experts": e,
        "mean": float(off.mean()),
        "min": float(off.min()),
        "max": float(off.max()),
        "critical": int((best_other < rho).sum()) if rho > 0 else 0,
    }


def summarize(sim: Similarity, rho: float) -> dict[int, dict]:
    return {layer: layer_summary(sim[layer], rho) for layer in sim}


def format_summary(sim: Similarity, rho: float) -> str:
    meta = sim.metadata
    head = [f"method={meta.get('method', '?')} tokens={meta.get('tokens', '?')} "
            f"model={meta.get('architecture', '?')} fingerprint={meta.get('weights_fingerprint', '?')}"]
    head.append(f"{'layer':>5} {'experts':>7} {'mean':>7} {'min':>7} {'max':>7} {'critical@' + format(rho, 'g'):>12}")
    for layer, s in summarize(sim, rho).items():
        head.append(f"{layer:>5} {s['experts']:>7} {s['mean']:>7.3f} {s['min']:>7.3f} {s['max']:>7.3f} {s['critical']:>12}")
    return "\n".join(head)


def plot(sim: Similarity, out_dir: str | os.PathLike) -> list[str]:
    """One heat map per layer (``layer_<i>.png``) and an overview grid (``overview.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    method = sim.metadata.get("method", "similarity")
    paths = []
    for layer in sim:
        fig, ax = plt.subplots(figsize=(5.5, 4.6))
        im = ax.imshow(sim[layer].numpy(), vmin=0, vmax=1, cmap="viridis", interpolation="nearest")
        ax.set_title(f"layer {layer}: {method} similarity")
        ax.set_xlabel("expert")
        ax.set_ylabel("expert")
        fig.colorbar(im, ax=ax, fraction=0.046)
        path = os.path.join(out_dir, f"layer_{layer}.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    n = len(sim)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    im = None
    for ax, layer in zip(axes.flat, sim):
        im = ax.imshow(sim[layer].numpy(), vmin=0, vmax=1, cmap="viridis", interpolation="nearest")
        ax.set_title(f"layer {layer}", fontsize=9)
    if im is not None:  # one scale for every panel (vmin/vmax fixed), so one colour bar
        fig.colorbar(im, ax=list(axes.flat), fraction=0.046 / rows, label=f"{method} similarity")
    fig.suptitle(f"{method} similarity, all MoE layers")
    path = os.path.join(out_dir, "overview.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    paths.append(path)
    return paths
