import os
import sys

# Triton kernels are tested on the CPU through the interpreter; it must be chosen
# before triton compiles anything, i.e. before sere_fx is imported.
try:
    import torch

    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))


# The longest modules first: the two pytest-xdist workers (--dist loadscope, pyproject.toml) take
# modules in collection order, so a long module collected last would run alone at the end.
_LONGEST_FIRST = ("test_vllm_engine.py", "test_vllm_pipeline.py", "test_vllm_server.py", "test_cli.py", "test_export.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
