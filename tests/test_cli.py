"""The command line as a shell user meets it."""

from __future__ import annotations

import subprocess
import sys

import torch

from sere_fx import Similarity


def test_top_level_help_reads_as_prose():
    out = subprocess.run([sys.executable, "-m", "sere_fx.cli", "--help"], capture_output=True, text=True, check=True)
    assert "``" not in out.stdout
    assert "Batch-aware expert re-routing (SERE)" in out.stdout


def test_inspect_into_a_closed_pipe_stops_quietly(tmp_path):
    path = tmp_path / "sim.safetensors"
    g = torch.Generator().manual_seed(0)
    Similarity({i: torch.rand(16, 16, generator=g) for i in range(40)}).save(path)
    proc = subprocess.run(f"{sys.executable} -m sere_fx.cli inspect {path} | head -1", shell=True,
                          capture_output=True, text=True)
    assert proc.returncode == 0
    assert len(proc.stdout.splitlines()) == 1
    assert "BrokenPipeError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
