"""lm-evaluation-harness on the transformers and the offline vLLM front-ends (docs/evaluation.md),
on the test-bed with sere-fx's own tasks; the server route is in test_vllm_engine.py (it shares
that module's server).

What must hold on every route: the plain model and SERE with rho above every similarity (nothing
re-routed) score exactly alike; log-likelihood requests are prompt processing, so SERE leaves
their scores exactly as they are and re-routes no row for them; generation is re-routed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

if os.environ.get("CI"):
    import lm_eval  # noqa: F401  (CI installs the eval extra: these tests must run there, not skip)
else:
    pytest.importorskip("lm_eval")

from lm_eval_runs import GEN, LIMIT, LL, evaluate, lm_eval_commands, parsed  # noqa: E402

from sere_fx import resources  # noqa: E402  (its testbed_* names would be collected as tests)

HERE = os.path.dirname(os.path.abspath(__file__))


def edit_similarity_loop(a: str, b: str) -> float:
    """Plain Levenshtein dynamic programme."""
    if not a and not b:
        return 1.0
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    return 1.0 - d[-1][-1] / max(len(a), len(b))


def test_tasks_are_held_out_lines_and_score_as_plain_loops():
    sys.path.insert(0, resources.lm_eval_tasks())
    try:
        import utils
    finally:
        sys.path.remove(resources.lm_eval_tasks())
    docs = utils.documents()
    lines = open(resources.testbed_text()).read().split("\n")
    half = "\n".join(lines[: len(lines) // 2])
    assert len(docs) == 256
    for doc in docs:
        line = doc["context"].rsplit("\n", 1)[1] + doc["target"]  # the target's whole line
        assert doc["context"].count("\n") == 12 and len(line.strip()) >= 10 and doc["target"].strip()
        assert line.lstrip().split()[0] == doc["context"].rsplit("\n", 1)[1].strip()  # the prompt ends with its first word
        assert doc["context"] + doc["target"] not in half  # the held-out half only
    rng = np.random.default_rng(0)
    for doc in docs[:40]:
        cut = rng.integers(0, len(doc["target"]) + 1)
        guess = doc["target"][:cut] + "x" * int(rng.integers(0, 4))
        got = utils.process_results(doc, [guess + "\nmore"])  # a generation stops at its first newline
        assert got["exact_match"] == float(guess.rstrip() == doc["target"])
        assert got["edit_similarity"] == pytest.approx(edit_similarity_loop(guess.strip(), doc["target"].strip()))


def test_the_documented_model_args_reach_each_model_as_settings():
    commands = lm_eval_commands()
    vllm = parsed(commands["vllm"]).model_args
    assert vllm == {"pretrained": "DIR", "additional_config": {"sere": {"sim": "sim.safetensors", "S": 2, "rho": 0.0}}}
    hf = parsed(commands["sere-hf"])
    assert hf.model_args == {"pretrained": "DIR", "sim": "sim.safetensors", "S": 2, "rho": 0.0}
    assert hf.device == "cpu" and int(hf.batch_size) == 32
    server = parsed(commands["local-completions"]).model_args
    assert server["base_url"] == "http://localhost:8000/v1/completions" and server["num_concurrent"] == 32
    for argv in commands.values():
        args = parsed(argv)
        assert args.tasks == f"{GEN},{LL}" or args.tasks == [GEN, LL] or args.tasks == [f"{GEN},{LL}"], args.tasks
        assert args.include_path == resources.lm_eval_tasks()


@pytest.fixture(scope="module")
def testbed_sim(tmp_path_factory):
    from sere_fx.calibration import calibrate
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("lm_eval") / "sim.safetensors"
    model = AutoModelForCausalLM.from_pretrained(resources.testbed_model())
    windows = torch.randint(1, model.config.vocab_size, (16, 64), generator=torch.Generator().manual_seed(0))
    calibrate(model, [windows], progress=False).save(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_runs(testbed_sim):
    """The transformers route: plain, SERE with nothing re-routed, SERE (rho 0), each as lm-eval runs it."""
    from sere_fx.harness import SereHFLM

    common = dict(pretrained=resources.testbed_model(), device="cpu", batch_size=LIMIT)
    runs = {"plain": evaluate(SereHFLM(**common)),
            "identity": evaluate(SereHFLM(**common, sim=testbed_sim, S=2, rho=2.0))}
    sere = SereHFLM(**common, sim=testbed_sim, S=2, rho=0.0, stats=True)
    runs["sere_ll"] = evaluate(sere, tasks=[LL])
    runs["sere_ll_calls"] = sum(s.calls for s in sere.routing_stats().values())
    runs["sere"] = evaluate(sere, tasks=[GEN])
    runs["sere_stats"] = {i: s.as_dict() for i, s in sere.routing_stats().items()}
    return runs


def test_transformers_route(hf_runs):
    plain, identity, sere = hf_runs["plain"], hf_runs["identity"], hf_runs["sere"]
    assert identity == plain  # nothing re-routed: every score and response the plain model's
    assert 0.0 < plain["scores"][GEN]["edit_similarity"] < 1.0 and plain["scores"][LL]["nll_per_char"] > 0.0
    # log-likelihood requests are prompts: exactly the plain model's, and no router call re-routed
    assert hf_runs["sere_ll"]["responses"][LL] == plain["responses"][LL]
    assert hf_runs["sere_ll_calls"] == 0
    # generation: the batch's decode steps are re-routed (and the prompts' prefill is not counted)
    for layer in hf_runs["sere_stats"].values():
        assert layer["calls"] > 0 and layer["tokens"] <= LIMIT * layer["calls"]
        assert layer["mean_distinct_after"] < layer["mean_distinct_before"]
    assert sere["responses"][GEN] != plain["responses"][GEN]


def test_the_harness_command_line_as_documented(testbed_sim, tmp_path, monkeypatch, capsys):
    """``python -m sere_fx.harness`` as the documentation types it (DIR and the similarity file
    given, fewer documents); a mistake in the settings is one line and exit status 2."""
    from sere_fx.harness import main

    argv = lm_eval_commands()["sere-hf"]
    argv = [a.replace("pretrained=DIR", f"pretrained={resources.testbed_model()}").replace("sim=sim.safetensors", f"sim={testbed_sim}")
            for a in argv]
    argv = argv[argv.index("run"):]
    argv[argv.index("--limit") + 1] = "4"
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert GEN in out and LL in out and "edit_similarity" in out and "nll_per_char" in out
    bad = [a.replace("S=2", "S=99") for a in argv]
    assert main(bad) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("sere_fx.harness: error: --model_args: S: expected an integer in [1, 8]"), err[-3:]


VLLM_SCRIPT = """
import json, sys
if __name__ == "__main__":
    sys.path.insert(0, {here!r})
    from sere_fx.harness import vllm_model_class
    import sere_fx.vllm
    from lm_eval_runs import GEN, LL, evaluate
    sim = {sim!r}
    # lm-eval's vllm model as the documented command builds it (the plugin's settings in its model_args)
    lm = vllm_model_class()(pretrained={model!r}, additional_config={{"sere": {{"sim": sim, "S": 2, "rho": 2.0, "stats": True}}}},
              enforce_eager=True, max_model_len=1024, dtype="bfloat16", batch_size="auto")
    out = {{"identity": evaluate(lm)}}
    out["identity_stats"] = sere_fx.vllm.routing_stats(lm.model)
    lm.model.collective_rpc("sere_switch_routing", args=(None,))  # the plain engine: no plugin settings
    out["plain"] = evaluate(lm)
    lm.model.collective_rpc("sere_switch_routing", args=({{"sim": sim, "S": 2, "rho": 0.0, "stats": True}},))
    out["sere_ll"] = evaluate(lm, tasks=[LL])
    out["sere_ll_stats"] = sere_fx.vllm.routing_stats(lm.model)
    out["sere"] = evaluate(lm, tasks=[GEN])
    out["sere_stats"] = sere_fx.vllm.routing_stats(lm.model)
    print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm_runs(testbed_sim, tmp_path_factory):
    if os.environ.get("CI"):
        import vllm  # noqa: F401
    else:
        pytest.importorskip("vllm")
    script = tmp_path_factory.mktemp("lm_eval_vllm") / "run.py"
    script.write_text(VLLM_SCRIPT.format(here=HERE, sim=testbed_sim, model=resources.testbed_model()))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])


def test_vllm_offline_route(vllm_runs, hf_runs):
    plain, identity, sere = vllm_runs["plain"], vllm_runs["identity"], vllm_runs["sere"]
    assert identity == plain  # the plugin attached, nothing re-routed: the plain engine's every response
    for layer in vllm_runs["identity_stats"].values():
        assert layer["decode_steps"] > 0 and layer["slots_rerouted"] == 0
    # log-likelihood requests: prompts only; no decode step, the plain engine's scores
    assert vllm_runs["sere_ll"]["responses"][LL] == plain["responses"][LL]
    assert all(layer["decode_steps"] == 0 for layer in vllm_runs["sere_ll_stats"].values())
    for layer in vllm_runs["sere_stats"].values():
        assert layer["decode_steps"] > 0 and layer["distinct_after"] < layer["distinct_before"]
    assert sere["responses"][GEN] != plain["responses"][GEN]
    # the routes agree where they should: the plain engine and plain transformers (both bf16) on the
    # same log-likelihoods, to rounding
    assert vllm_runs["plain"]["scores"][LL]["nll_per_char"] == pytest.approx(hf_runs["plain"]["scores"][LL]["nll_per_char"],
                                                                            rel=0.02)
