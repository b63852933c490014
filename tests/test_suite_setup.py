"""The suite's own setup: pyproject.toml's pytest options on a checkout without the dev extra."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_without_pytest_xdist_the_suite_runs_in_one_process_and_says_so():
    # -p no:xdist stands for a checkout installed without the dev extra: the worker options in
    # addopts must not stop pytest, and the one-process run must be named
    test = "tests/test_cli.py::test_the_reading_judges_the_interval_as_printed"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", test],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "1 passed" in out, out
    assert "--numprocesses=2: pytest-xdist is not installed, so the suite runs in one process" in out, out
