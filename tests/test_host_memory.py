"""Freed host memory kept in the process (``sere_fx.host_memory``) for the commands that run a model on a CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sere_fx import host_memory

# A child process: keep (or not) freed memory as the environment says, then count the page faults of
# filling a fresh 32 MiB tensor, after a few of the same size were filled and freed.
_FAULTS = """
import resource, torch
from sere_fx.host_memory import keep_freed_memory
applied = keep_freed_memory()
def fill():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(8 << 20)  # 32 MiB of float32
    x.fill_(1.0)
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
for _ in range(4):
    fill()
print(applied, fill())
"""


def _faults(keep: str) -> tuple[str, int]:
    env = {**os.environ, host_memory.ENV: keep}
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")
def test_kept_memory_is_not_faulted_in_again():
    """Without it every fresh 32 MiB buffer is faulted in page by page (glibc maps and unmaps it); with it
    the buffer freed before is handed out again, already mapped."""
    pages = (32 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert _faults("0") == ("False", pytest.approx(pages, rel=0.1))
    applied, faults = _faults("1")
    assert applied == "True" and faults < pages // 20


def test_a_bad_setting_is_one_line_naming_the_variable(monkeypatch, capsys):
    from sere_fx.cli import main
    from sere_fx.resources import testbed_model, testbed_text

    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv(host_memory.ENV, "yes")
    rc = main(["eval", "--model", testbed_model(), "--data", testbed_text(), "--policies", "baseline"])
    err = capsys.readouterr().err
    assert rc == 2 and err == (f"sere-fx eval: error: {host_memory.ENV}: expected 0 or 1, got 'yes'\n")
