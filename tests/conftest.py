import os
import sys

import pytest

# Two pytest-xdist workers share the machine's cores (pyproject.toml): one compute thread each, and
# the vLLM engines a worker starts bound to a core of their own. Two workers with two OpenMP
# threads each, beside an engine spinning on both cores, made GEMM-bound tests 20x slower than
# alone; set before torch is imported, inherited by every process a test starts. An engine that
# needs both cores (tensor parallel) sets its own binding.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
_shared = _worker.startswith("gw") and _worker[2:].isdigit()
if _shared:
    _cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_cores[int(_worker[2:]) % len(_cores)]))

# Triton kernels are tested on the CPU through the interpreter; it must be chosen
# before triton compiles anything, i.e. before sere_fx is imported.
try:
    import torch

    _cuda = torch.cuda.is_available()
    if _shared:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch first
except Exception:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))


# The longest modules first: the two pytest-xdist workers (--dist loadscope, pyproject.toml) take
# modules in collection order, so a long module collected last would run alone at the end.
# (pyproject.toml passes --no-loadscope-reorder: xdist would otherwise order modules by their
# number of tests, and the engine modules, few tests of a minute each, would run last.)
_LONGEST_FIRST = ("test_vllm_engine.py", "test_vllm_pipeline.py", "test_export.py", "test_vllm_server.py",
                  "test_cli.py", "test_lm_eval.py", "test_compile.py", "test_decode_export.py")


# Without pytest-xdist (a checkout installed without the dev extra) pyproject.toml's worker options
# would stop pytest before it starts: accept them, run in one process, and say so.
def pytest_addoption(parser, pluginmanager):
    if pluginmanager.has_plugin("xdist"):
        return
    group = parser.getgroup("sere-fx", "without pytest-xdist")
    group.addoption("--numprocesses", dest="sere_fx_numprocesses", default=None,
                    help="accepted without pytest-xdist: the suite runs in one process")
    group.addoption("--dist", dest="sere_fx_dist", default=None, help="accepted without pytest-xdist")
    group.addoption("--no-loadscope-reorder", dest="sere_fx_no_reorder", action="store_true",
                    help="accepted without pytest-xdist")


def pytest_configure(config):
    if not config.pluginmanager.has_plugin("xdist") and config.getoption("sere_fx_numprocesses") not in (None, "0"):
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"--numprocesses={config.getoption('sere_fx_numprocesses')}: pytest-xdist is not installed, so the "
            "suite runs in one process (pip install -e '.[dev]' installs it)"), stacklevel=2)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
