"""``sere-fx demo``: calibrate -> transform -> evaluate -> time, on the embedded test-bed model.

The embedded text is cut in two: the first 40,000 tokens calibrate the similarities, the
rest is used for evaluation and timing, so nothing is measured on the text it was fitted on.
"""

from __future__ import annotations

import os
import time

import torch

CALIBRATION_TOKENS = 40_000


def speedup_verdict(speedup: float, limit: float) -> str:
    """What a measured speed-up means next to the limit the experts read allow: a figure above the
    limit cannot come from reading fewer experts, so it is reported as noise, never as a gain."""
    if speedup > limit:
        return f"above the limit of {limit:.2f}x: timing noise on this machine, not a real gain (rerun on a quiet machine)"
    return f"the limit from experts read is {limit:.2f}x on the MoE layers alone"


def speedup_reading(timing) -> str:
    """Which figure to read. Each pair times both sides back to back, so the machine's drift cancels
    in its ratio; the two medians above are taken over all samples of each side, and their ratio
    is not the speed-up (on a busy machine it can be far from it)."""
    s = timing.speedup
    # judged on the interval as printed (2 decimals): a p10 of 1.003 reads "1.00", which includes 1x
    resolved = ("" if round(s.p10_s, 2) > 1.0 or round(s.p90_s, 2) < 1.0 else
                "; the speed-up's [p10, p90] includes 1x: no difference resolved on this machine at this size")
    ratio = timing.baseline.median_s / timing.policy.median_s
    return (f"  read the speed-up line: the median of the {s.repeats} per-pair ratios baseline / SERE; the ratio of "
            f"the two step medians ({ratio:.2f}x) mixes moments of the machine and is not a measurement{resolved}")


def run(out_dir: str = "sere-demo", *, num_eval_seqs: int = 64, steps: int = 64, batch_size: int = 32,
        progress: bool = True) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import sere_fx
    from sere_fx.benchmark import paired_decode_timing
    from sere_fx.calibration import batched, calibrate, read_documents, token_windows
    from sere_fx.calibration.inspect import plot
    from sere_fx.evaluate import evaluate
    from sere_fx.resources import testbed_model, testbed_text

    torch.manual_seed(0)
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(testbed_model())
    docs = read_documents(testbed_text())

    print(f"[1/4] calibrating expert similarity (frobenius) on tokens 0:{CALIBRATION_TOKENS} ...", flush=True)
    cal = token_windows(tokenizer, docs, 128, 200, token_range=(0, CALIBRATION_TOKENS))
    sim = calibrate(model, batched(cal, 16), "frobenius", progress=progress, total=-(-cal.shape[0] // 16))
    sim.save(os.path.join(out_dir, "sim.safetensors"))
    plot(sim, os.path.join(out_dir, "similarity"))

    print(f"[2/4] batched decode evaluation (batch {batch_size}) on tokens {CALIBRATION_TOKENS}: ...", flush=True)
    windows = token_windows(tokenizer, docs, 4 + steps + 1, num_eval_seqs, token_range=(CALIBRATION_TOKENS, None))
    # weight:S=1,N=0.6 reads 40% fewer experts than each step picks: about OEA S=2's count here
    policies = ["baseline", "sere:S=2,rho=0.5", "sere:S=2,rho=0", "oea:S=2", "weight:S=1,N=0.6"]
    report = evaluate(model, windows, policies, sim, batch_size=batch_size, prefill=4, progress=progress)
    paths = report.save(out_dir)

    print("[3/4] timing decode steps, baseline vs SERE S=2 rho=0, interleaved ...", flush=True)
    batch = token_windows(tokenizer, docs, 32, batch_size, token_range=(CALIBRATION_TOKENS, None))
    sere_fx.transform(model, sim, S=2, rho=0.0)
    timing = paired_decode_timing(model, batch)
    sere_fx.restore(model)

    print("[4/4] summary", flush=True)
    base = report.results[0]
    sere = next(r for r in report.results if r.label == "sere:S=2,rho=0")
    limit = base.distinct / sere.distinct
    verdict = speedup_verdict(timing.speedup.median_s, limit)
    lines = [
        "",
        "sere-fx demo: embedded test-bed model (Qwen3-MoE, 4 MoE layers x 64 experts, top-8)",
        report.table(),
        "",
        f"decode step at batch {batch_size} (median [p10, p90] of {timing.speedup.repeats}, interleaved): baseline "
        f"{timing.baseline.fmt()}, SERE S=2 rho=0 {timing.policy.fmt()}",
        f"speed-up {timing.fmt_speedup()} (per-pair ratios); {verdict} (the test-bed's experts are tiny, so "
        "attention, embeddings and Python overhead dominate a step here; see bench/ for MoE-layer timings at real "
        "sizes)",
        speedup_reading(timing),
        "",
        f"files in {out_dir}/: {os.path.basename(paths['json'])}, {os.path.basename(paths['png'])} (retention vs experts), "
        "sim.safetensors, similarity/*.png (heat maps)",
        f"total {time.perf_counter() - t0:.0f} s",
    ]
    print("\n".join(lines))
    return {"report": report, "timing": timing, "limit": limit}
