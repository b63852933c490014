"""What the one-engine-per-setting vLLM benchmarks share: a test-bed similarity file, and each
setting's engine run in its own child process (so engines' memory and plugin state stay apart).

A benchmark script ``S`` calls ``run_settings(S, settings, spec)``; for each setting it writes
``{**spec, "sere": ..., "out": ...}`` to a file and runs ``python S --child FILE``, whose
``one_engine(spec)`` result the child writes to ``spec["out"]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTBED = os.path.abspath(os.path.join(HERE, "..", "..", "shared", "testbed"))
TESTBED_MODEL = os.path.join(TESTBED, "model")


def testbed_similarity(path: str | None = None) -> str:
    """``path``, or a Frobenius similarity calibrated on 64 x 64 tokens of the public text (made once)."""
    if path is not None:
        return path
    path = os.path.join(HERE, "results", ".testbed.sim.safetensors")
    if not os.path.isfile(path):
        subprocess.run([sys.executable, "-m", "sere_fx.cli", "calibrate", "--model", TESTBED_MODEL, "--data",
                        os.path.join(TESTBED, "eval_public.txt"), "--num-seqs", "64", "--seq-len", "64",
                        "--out", path], check=True)
    return path


def run_settings(script: str, settings: dict, spec: dict, env: dict | None = None) -> dict:
    """``{name: one_engine result}`` for ``settings`` (``{name: additional_config["sere"] or None}``)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    tag = os.path.splitext(os.path.basename(script))[0]
    results = {}
    for name, sere in settings.items():
        spec_path = os.path.join(HERE, "results", f".{tag}_{name}.json")
        out_path = spec_path.replace(".json", ".out.json")
        json.dump({**spec, "sere": sere, "out": out_path}, open(spec_path, "w"))
        print(f"{name}: starting an engine ...", flush=True)
        subprocess.run([sys.executable, script, "--child", spec_path], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results[name] = json.load(open(out_path))
        os.remove(spec_path)
        os.remove(out_path)
    return results


def add_common_arguments(parser) -> None:
    """``--sim``, ``--out`` and the hidden ``--child`` that ``run_settings`` passes."""
    parser.add_argument("--sim", default=None, help="similarity file (default: calibrated here on the public text)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)


def child(one_engine, spec_path: str) -> None:
    """In the child process: run ``one_engine`` on the spec and write its result."""
    spec = json.load(open(spec_path))
    json.dump(one_engine(spec), open(spec["out"], "w"))
