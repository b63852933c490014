"""Where offloaded experts live: a slower tier that an expert cache fetches from, one expert at a time.

- ``DiskStore``: one file per MoE layer, every expert's weights in one 4 KiB-aligned block, read
  with ``O_DIRECT`` so each fetch comes from the disk and not from the page cache (where the file
  system refuses ``O_DIRECT``, tmpfs say, the pages read are dropped with ``POSIX_FADV_DONTNEED``
  after each read, and ``direct`` says so).
- ``MemoryStore``: the experts in host memory (pinned when CUDA is there), for a model on a GPU.

A store file is written to ``<path>.partial`` and renamed only once complete and synced, and it ends
with a footer that repeats its header's digest: a file a killed process left behind is either a
``.partial`` (removed) or fails the size and footer checks, and is rebuilt, never read as valid.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os

import torch

from sere_fx.errors import argument_error

ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffers aligned to the device's block
_MAGIC = b"SEREFX-EXPERTS-1"
_FOOTER = b"SEREFX-COMPLETE-1"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def expert_tensors(experts) -> tuple[torch.Tensor, ...]:
    """The per-expert weights of a transformers experts module, each ``[E, ...]`` (the default layout)."""
    return (experts.gate_up_proj, experts.down_proj)


def weights_digest(tensors) -> str:
    """What identifies a layer's experts cheaply: shapes, dtype and each expert's first and last 4 KiB.
    (Hashing every byte of a 30B model's experts would cost as long as writing them.)"""
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.detach().reshape(t.shape[0], -1).cpu()
        raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
        for e in range(raw.shape[0]):
            h.update(raw[e, :ALIGN].numpy().tobytes())
            h.update(raw[e, -ALIGN:].numpy().tobytes())
    return h.hexdigest()[:32]


class MemoryStore:
    """A layer's experts in host memory; ``fetch`` copies one into a fast-tier slot."""

    direct = False

    def __init__(self, tensors):
        pin = torch.cuda.is_available()
        self.tensors = tuple(t.detach().to("cpu").contiguous().pin_memory() if pin else t.detach().to("cpu").clone()
                             for t in tensors)
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in self.tensors)

    def make_slots(self, capacity: int, device) -> tuple[torch.Tensor, ...]:
        """The cache's ``capacity`` slots of each tensor, in fast memory on ``device``."""
        return tuple(torch.empty((capacity,) + tuple(t.shape[1:]), dtype=t.dtype, device=device) for t in self.tensors)

    def fetch(self, expert: int, out: tuple[torch.Tensor, ...], slot: int | None = None) -> None:
        """Copy ``expert`` into ``out`` (its views in one slot)."""
        for src, dst in zip(self.tensors, out):
            dst.copy_(src[expert], non_blocking=True)

    def close(self) -> None:
        pass


class DiskStore:
    """A layer's experts in a file; ``fetch`` reads one expert's block from the disk."""

    def __init__(self, path: str, shapes, dtype: torch.dtype, digest: str):
        self.path = path
        self.shapes = [tuple(s) for s in shapes]
        self.dtype = dtype
        self.digest = digest
        item = torch.empty((), dtype=dtype).element_size()
        self.sizes = [int(torch.Size(s).numel()) * item for s in self.shapes]
        self.expert_bytes = sum(self.sizes)
        self.block = _align(self.expert_bytes)
        self._buf = mmap.mmap(-1, self.block)  # page-aligned, as O_DIRECT wants
        try:
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            self.direct = hasattr(os, "O_DIRECT")
            os.preadv(self._fd, [self._buf], ALIGN)  # some file systems accept the flag and refuse the read
        except OSError:
            if getattr(self, "_fd", None) is not None:
                os.close(self._fd)
            self._fd = os.open(path, os.O_RDONLY)
            self.direct = False

    def make_slots(self, capacity: int, device) -> tuple[torch.Tensor, ...]:
        """The cache's slots. On the CPU they are views into one page-aligned buffer laid out as the
        file is (one block an expert), so a fetch reads straight into its slot, with no copy."""
        device = torch.device(device)
        if device.type != "cpu":
            self._slots = None
            return tuple(torch.empty((capacity,) + s, dtype=self.dtype, device=device) for s in self.shapes)
        self._slots = mmap.mmap(-1, capacity * self.block)
        raw = torch.frombuffer(self._slots, dtype=torch.uint8).view(capacity, self.block)
        views, start = [], 0
        for size, shape in zip(self.sizes, self.shapes):
            views.append(raw[:, start:start + size].view(self.dtype).view((capacity,) + shape))
            start += size
        return tuple(views)

    def fetch(self, expert: int, out: tuple[torch.Tensor, ...], slot: int | None = None) -> None:
        """Read ``expert``'s block from the disk into ``slot`` of ``make_slots``' buffer (on the CPU), else
        into a bounce buffer copied to ``out`` (its views in one slot)."""
        offset = ALIGN + expert * self.block
        direct_slot = slot is not None and getattr(self, "_slots", None) is not None
        target = memoryview(self._slots)[slot * self.block:(slot + 1) * self.block] if direct_slot else self._buf
        got = os.preadv(self._fd, [target], offset)
        if got < self.expert_bytes:
            raise OSError(f"{self.path}: short read of expert {expert} ({got} of {self.expert_bytes} bytes)")
        if not self.direct:  # the next read of this expert must come from the disk again
            os.posix_fadvise(self._fd, offset, self.block, os.POSIX_FADV_DONTNEED)
        if direct_slot:
            return
        start = 0
        view = memoryview(self._buf)
        for size, shape, dst in zip(self.sizes, self.shapes, out):
            src = torch.frombuffer(view[start:start + size], dtype=self.dtype).view(shape)
            dst.copy_(src)
            start += size

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _header(tensors, digest: str) -> bytes:
    meta = {"shapes": [list(t.shape[1:]) for t in tensors], "experts": int(tensors[0].shape[0]),
            "dtype": str(tensors[0].dtype).removeprefix("torch."), "digest": digest}
    raw = _MAGIC + json.dumps(meta, sort_keys=True).encode()
    if len(raw) > ALIGN:
        raise ValueError("store header does not fit in one block")
    return raw.ljust(ALIGN, b"\0")


def _expected_size(tensors) -> int:
    per = _align(sum(t[0].numel() * t.element_size() for t in tensors))
    return ALIGN + tensors[0].shape[0] * per + ALIGN


def is_complete(path: str, tensors, digest: str) -> bool:
    """Whether ``path`` is a whole store file of exactly these experts (size, header and footer)."""
    try:
        if os.path.getsize(path) != _expected_size(tensors):
            return False
        with open(path, "rb") as f:
            header = f.read(ALIGN)
            f.seek(-ALIGN, os.SEEK_END)
            footer = f.read(ALIGN)
    except OSError:
        return False
    want = _header(tensors, digest)
    return header == want and footer == (_FOOTER + hashlib.sha256(want).digest()).ljust(ALIGN, b"\0")


def write_store(path: str, tensors, digest: str) -> None:
    """Write a store file of ``tensors`` (each ``[E, ...]``) at ``path``, atomically (``.partial``,
    synced, renamed). A full disk or an unwritable path raises ``ArgumentError('store')``."""
    partial = path + ".partial"
    header = _header(tensors, digest)
    block = _align(sum(t[0].numel() * t.element_size() for t in tensors))
    cpu = [t.detach().to("cpu").contiguous() for t in tensors]
    try:
        with open(partial, "wb") as f:
            f.write(header)
            for e in range(cpu[0].shape[0]):
                raw = b"".join(t[e].view(torch.uint8).numpy().tobytes() for t in cpu)
                f.write(raw.ljust(block, b"\0"))
            f.write((_FOOTER + hashlib.sha256(header).digest()).ljust(ALIGN, b"\0"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except OSError as exc:
        try:
            os.remove(partial)
        except OSError:
            pass
        raise argument_error("store", f"store: expected a directory the expert store can be written to, "
                                      f"got {os.path.dirname(path)!r} ({exc.strerror or exc})") from None


def open_disk_store(directory: str, name: str, tensors, log=None) -> DiskStore:
    """The store of one layer's experts in ``directory`` (written, or rebuilt when what is there is
    incomplete or holds other weights); ``log``: where to say that a file was rebuilt."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise argument_error("store", f"store: expected a directory the expert store can be written to, got "
                                      f"{directory!r} ({exc.strerror or exc})") from None
    path = os.path.join(directory, f"{name}.experts")
    digest = weights_digest(tensors)
    if os.path.exists(path + ".partial"):  # a killed writer's leftover: never read
        os.remove(path + ".partial")
    if not is_complete(path, tensors, digest):
        if os.path.exists(path) and log is not None:
            log(f"store: {path} is incomplete or holds other weights; rebuilding it")
        write_store(path, tensors, digest)
    return DiskStore(path, [t.shape[1:] for t in tensors], tensors[0].dtype, digest)
