"""CPU kernel for ``sere.reroute``: ``reroute.c``, built once with the system's C compiler and
called through ``ctypes`` on the tensors' own memory.

At decode sizes (T = 32 tokens, K = 8, E = 128) the work is a few thousand operations and
the cost is overhead: the vectorised PyTorch version spends ~190 us in a dozen dispatches and
two E x E passes, a NumPy version of ~20 calls ~20 us warm and ~75 us between two layers' matrix
products inside an engine (cold caches). The C kernel is one call of ~1 us; what remains is
``ctypes``' argument conversion (~2 us).

It needs each expert's candidates sorted by similarity, descending, ties to the lower index
(the first primary one is then ``argmax`` over primaries with the lowest index among ties, as
the op's definition says): made once per similarity matrix and cached.

Building: ``cc -O2 -shared -fPIC`` (the compiler Inductor uses on the CPU too; ``$CC`` if set)
into ``$SERE_FX_CACHE`` (default ``~/.cache/sere-fx``), keyed by the source's hash, written
atomically so that concurrent processes (vLLM workers, test runners) can race safely. Where no
compiler works, ``available()`` is False and ``sere_fx.ops`` uses the PyTorch implementation
(one warning says so).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings

import numpy as np
import torch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reroute.c")
_LIB: ctypes.CDLL | None | bool = None  # None: not tried yet; False: could not build
_CACHE: dict[tuple, tuple] = {}
_CACHE_SIZE = 256
_FNS: dict[torch.dtype, object] = {}  # ids dtype -> kernel
_GROUP_FNS: dict[torch.dtype, object] = {}  # ids dtype -> the kernel over stacked groups
_MAX = [0, 0]  # experts and slots the kernel takes at most (0 until built)


def _build() -> str:
    source = open(SOURCE, "rb").read()
    digest = hashlib.sha256(source).hexdigest()[:16]
    cache = os.environ.get("SERE_FX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sere-fx")
    path = os.path.join(cache, f"reroute-{digest}.so")
    if os.path.isfile(path):
        return path
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler found (looked for $CC, cc, gcc, clang)")
    os.makedirs(cache, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", tmp, SOURCE], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, path)  # atomic: a racing process sees no file or the whole file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def _library():
    global _LIB
    if _LIB is None:
        try:
            # PyDLL: the call keeps the GIL (releasing it costs more than the ~1 us kernel)
            lib = ctypes.PyDLL(_build())
            args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_void_p]
            for fn in (lib.sere_reroute_i32, lib.sere_reroute_i64):
                fn.argtypes, fn.restype = args, ctypes.c_int
            for fn in (lib.sere_reroute_groups_i32, lib.sere_reroute_groups_i64):
                fn.argtypes, fn.restype = args[:2] + [ctypes.c_int64] + args[2:], ctypes.c_int
            _FNS.update({torch.int32: lib.sere_reroute_i32, torch.int64: lib.sere_reroute_i64})
            _GROUP_FNS.update({torch.int32: lib.sere_reroute_groups_i32, torch.int64: lib.sere_reroute_groups_i64})
            _MAX[:] = [lib.sere_max_experts(), lib.sere_max_slots()]
            _LIB = lib
        except (OSError, RuntimeError) as exc:
            warnings.warn(f"sere-fx: the CPU re-routing kernel could not be built ({exc}); sere.reroute uses its "
                          "PyTorch implementation on the CPU (slower at decode sizes)", RuntimeWarning, stacklevel=3)
            _LIB = False
    return _LIB or None


def available() -> bool:
    """Whether the C kernel is built and loaded (builds it on first call)."""
    return _library() is not None


def fits(num_experts: int, k: int) -> bool:
    """Whether the kernel takes E experts and K slots (False where it could not be built)."""
    if _LIB is None:
        _library()
    return num_experts <= _MAX[0] and k <= _MAX[1]


def candidates(similarity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float32 similarity, int32 [E, E] candidates)`` for ``similarity``, cached.

    The entry holds the tensor, so its id cannot be reused while the entry exists;
    ``_version`` changes with any in-place update."""
    key = (id(similarity), similarity._version)
    hit = _CACHE.get(key)
    if hit is None:
        sim = similarity.detach().to(torch.float32).contiguous()
        values = sim.numpy()
        e = values.shape[0]
        order = np.lexsort((np.broadcast_to(np.arange(e), (e, e)), -values), axis=1)
        hit = (similarity, sim, torch.from_numpy(np.ascontiguousarray(order, dtype=np.int32)))
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = hit
    return hit[1], hit[2]


def launch(topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rho: float, rank_values: torch.Tensor | None,
           valid_rows: torch.Tensor | None, free_rows: torch.Tensor | None) -> torch.Tensor:
    """The kernel on contiguous CPU tensors, no checks: ``topk_ids`` int32/int64 ``[T, K]``,
    ``rank_values`` float32 ``[T, K]``, ``valid_rows`` / ``free_rows`` bool with at least ``T``
    entries (only the first ``T`` are read, so an engine passes its persistent row buffers
    without slicing them); ``fits(E, K)``. Or ``G`` independent calls stacked, each by the same kernel,
    in one kernel call: ``topk_ids`` / ``rank_values [G, T, K]``, ``valid_rows`` / ``free_rows [G, T]``
    (the op's batching rule)."""
    sim, cand = candidates(similarity)
    out = torch.empty_like(topk_ids)
    *groups, t, k = topk_ids.shape
    rest = (sim.shape[0], S, sim.data_ptr(), cand.data_ptr(), rho,
            None if rank_values is None else rank_values.data_ptr(), None if valid_rows is None else valid_rows.data_ptr(),
            None if free_rows is None else free_rows.data_ptr())
    if groups:
        _GROUP_FNS[topk_ids.dtype](topk_ids.data_ptr(), out.data_ptr(), groups[0], t, k, *rest)
    else:
        _FNS[topk_ids.dtype](topk_ids.data_ptr(), out.data_ptr(), t, k, *rest)
    return out


def _contiguous(t: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    if t is None:
        return None
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def reroute(topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rho: float,
            rank_values: torch.Tensor | None = None, valid_rows: torch.Tensor | None = None,
            free_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``sere.reroute`` for CPU tensors (same contract as ``sere_fx.ops.reroute_aten``), or for ``G`` stacked
    calls (``topk_ids [G, T, K]``, the optional tensors stacked the same way) in one kernel call; call only
    when ``fits(E, K)``."""
    return launch(_contiguous(topk_ids), similarity, S, rho, _contiguous(rank_values, torch.float32),
                  _contiguous(valid_rows), _contiguous(free_rows))


# --- the engine's native op ------------------------------------------------------------------
# ``engine_op.cpp``: the vLLM plugin's per-layer ops as CPU kernels of their own
# (``torch.ops.sere_native.engine_reroute`` / ``engine_rows``, and ``fused_moe``: vLLM's CPU
# fused-MoE kernel with exact slot merging), dispatched from vLLM's compiled graph without a
# Python frame. A PyTorch C++ extension, built once per torch version with
# ``torch.utils.cpp_extension`` (~15 s on a 2-core machine; cached in ``$TORCH_EXTENSIONS_DIR``).
_NATIVE: bool | None = None


def load_engine_op() -> bool:
    """Build (once) and load the engine's native ops; False, with one warning, where that fails."""
    global _NATIVE
    if _NATIVE is None:
        try:
            from torch.utils import cpp_extension

            here = os.path.dirname(SOURCE)
            op = os.path.join(here, "engine_op.cpp")
            # torch rebuilds when the listed source changes, not when the C file it includes
            # does: both go into the name
            digest = hashlib.sha256(open(op, "rb").read() + open(SOURCE, "rb").read()).hexdigest()[:12]
            cpp_extension.load(name=f"sere_fx_engine_op_{digest}", sources=[op],
                               extra_include_paths=[here], extra_cflags=["-O3"], is_python_module=False,
                               verbose=False)

            @torch.library.register_fake("sere_native::engine_reroute")
            def _(topk_ids, similarity, candidates, S, rho, rank_values):
                return torch.empty_like(topk_ids)

            @torch.library.register_fake("sere_native::engine_rows")
            def _(topk_ids, num_experts):
                return (topk_ids.new_empty(topk_ids.shape[0], dtype=torch.bool),
                        topk_ids.new_empty(num_experts, dtype=torch.bool))

            @torch.library.register_fake("sere_native::fused_moe")
            def _(output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, skip_weighted, act, isa):
                return None

            @torch.library.register_fake("sere_native::slot_pairs")
            def _(topk_ids, topk_weights, num_experts):
                m = torch.library.get_ctx().new_dynamic_size()
                return (topk_ids.new_empty(m, dtype=torch.int64), topk_ids.new_empty(m),
                        topk_weights.new_empty(m))

            _NATIVE = True
        except Exception as exc:  # no compiler, no ninja, headers missing: the Python op serves
            warnings.warn(f"sere-fx: the engine's native CPU ops could not be built ({type(exc).__name__}: "
                          f"{str(exc)[:300]}); the plugin runs its Python ops", RuntimeWarning, stacklevel=2)
            _NATIVE = False
    return _NATIVE
