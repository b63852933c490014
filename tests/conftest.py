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
