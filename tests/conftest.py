import os
import sys

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


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
