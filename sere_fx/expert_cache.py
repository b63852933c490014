"""Experts that do not fit in fast memory: ``sere_fx.offload`` keeps C experts per MoE layer in a cache.

    sere_fx.offload(model, cache=0.25, store="experts/")   # CPU model: experts read from files on disk
    sere_fx.transform(model, sim, S=1, rho=0.5)             # now cache-aware (below)
    sere_fx.cache_stats(model)                              # {layer: CacheCounters}

Each MoE layer's ``experts`` module is replaced by an ``OffloadedExperts``: its weights live in a
store (``sere_fx.expert_store``: a file per layer for a CPU model, host memory for a GPU model), and C
of them in a cache in the model's own memory. A call computes its active experts one at a time:
the ones in the cache first, then each missing one is fetched into the least recently used slot.
With the model's own routing that is exact routing with LRU eviction, the baseline of every figure.

**Cache-aware routing.** A model transformed after ``offload`` routes with the cache in view: each
router reads its layer's *resident* set (bool ``[E]``, the buffer ``sere_resident``, updated in
place by the cache) as experts that cost nothing to read, the policies' ``free`` experts
(``sere_fx.policies``): SERE's primaries include them (a missing expert goes to its most similar
resident one when that similarity is at least rho, else it is fetched); ``weight`` / ``output``
fetch a missing expert only when its importance reaches rho and refill from what is resident;
``prior`` (the Cache-Prior rule) biases each token's scores toward resident experts. At batch > 1
the batch's own primaries come on top, as without a cache.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from sere_fx.discovery import find_moe_blocks
from sere_fx.errors import argument_error
from sere_fx.expert_store import MemoryStore, expert_tensors, open_disk_store
from sere_fx.kernels.experts_cpu import run_experts, standard_layout

RESIDENT_BUFFER = "sere_resident"
TIERS = ("disk", "memory")


@dataclass
class CacheCounters:
    """What one layer's cache did while counting: calls, the tokens they carried, experts served from
    the cache (hits) and fetched (misses), and the bytes those fetches read."""

    calls: int = 0
    tokens: int = 0
    hits: int = 0
    misses: int = 0
    bytes: int = 0

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else 0.0

    @property
    def hit_rate(self) -> float:
        served = self.hits + self.misses
        return self.hits / served if served else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "misses_per_token": self.misses_per_token, "hit_rate": self.hit_rate}


def cache_size(cache, num_experts: int, where: str = "cache") -> int:
    """``cache`` as a count of experts for a layer of ``num_experts``: an int in [1, E - 1], or a
    fraction in (0, 1) of E (rounded down, at least 1)."""
    if isinstance(cache, bool) or not isinstance(cache, (int, float)):
        raise argument_error(where, f"{where}: expected an int count of experts or a fraction in (0, 1), got "
                                    f"{cache!r}", TypeError)
    if isinstance(cache, float):
        if not 0 < cache < 1:
            raise argument_error(where, f"{where}: expected a fraction in (0, 1) of the layer's experts, got {cache}")
        return max(1, int(cache * num_experts + 1e-9))
    if not 1 <= cache < num_experts:
        raise argument_error(where, f"{where}: expected a count in [1, {num_experts - 1}] (below the layer's "
                                    f"{num_experts} experts), got {cache}")
    return cache


class ExpertCache:
    """C slots of one layer's experts in fast memory, filled from ``store`` on a miss, LRU eviction."""

    def __init__(self, store, capacity: int, like: tuple[torch.Tensor, ...], device: torch.device):
        self.store = store
        self.capacity = capacity
        self.num_experts = int(like[0].shape[0])
        self.slots = store.make_slots(capacity, device)  # a disk store on the CPU reads straight into them
        self.resident = torch.zeros(self.num_experts, dtype=torch.bool, device=device)  # read by the router
        self.counters = CacheCounters()
        self.counting = True
        self.reset()

    def reset(self) -> None:
        """Empty the cache and zero the counters (each evaluated policy starts from the same state)."""
        self.slot_expert = [-1] * self.capacity
        self.slot_of = [-1] * self.num_experts
        self.last_used = [-1] * self.capacity  # never used: evicted first, lowest slot first
        self.clock = 0
        self.resident.zero_()
        self.counters = CacheCounters()

    def _touch(self, slot: int) -> None:
        self.clock += 1  # one tick per use: within a call too, the least recently used goes first
        self.last_used[slot] = self.clock

    def serve(self, active: list[int], tokens: int):
        """Yield ``(expert, *weights)`` for each of ``active``: resident ones first (all touched before
        any fetch, so a fetch evicts none of this call's hits while others can go), then each missing
        one fetched into the least recently used slot. Consume in order: a slot may be reused once the
        expert yielded from it has been computed."""
        hits = [e for e in active if self.slot_of[e] >= 0]
        misses = [e for e in active if self.slot_of[e] < 0]
        for e in hits:
            self._touch(self.slot_of[e])
        if self.counting:
            c = self.counters
            c.calls += 1
            c.tokens += tokens
            c.hits += len(hits)
            c.misses += len(misses)
            c.bytes += len(misses) * self.store.expert_bytes
        for e in hits:
            slot = self.slot_of[e]
            yield (e, *(t[slot] for t in self.slots))
        for e in misses:
            slot = min(range(self.capacity), key=lambda s: (self.last_used[s], s))
            old = self.slot_expert[slot]
            if old >= 0:
                self.slot_of[old] = -1
                self.resident[old] = False
            self.store.fetch(e, tuple(t[slot] for t in self.slots), slot)
            self.slot_expert[slot], self.slot_of[e] = e, slot
            self._touch(slot)
            self.resident[e] = True
            yield (e, *(t[slot] for t in self.slots))


class OffloadedExperts(nn.Module):
    """A transformers experts module whose weights are in a store, C of them cached (``ExpertCache``).
    Called as the module it replaces: ``(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])``."""

    def __init__(self, original: nn.Module, cache: ExpertCache):
        super().__init__()
        self.num_experts = cache.num_experts
        self.act_fn = original.act_fn
        self.cache = cache
        for i, t in enumerate(cache.slots):  # buffers: discovery reads the experts' dtype and device from them
            self.register_buffer(f"cache_slots_{i}", t, persistent=False)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return run_experts(hidden_states, top_k_index, top_k_weights, self.num_experts, self.act_fn,
                           lambda active: self.cache.serve(active, hidden_states.shape[0]))

    def extra_repr(self) -> str:
        tier = "disk" if hasattr(self.cache.store, "path") else "memory"
        return f"num_experts={self.num_experts}, cache={self.cache.capacity}, tier={tier}"


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def offload(model: nn.Module, cache, store: str | None = None, *, tier: str | None = None,
            device=None, progress: bool = True) -> nn.Module:
    """Move every MoE layer's expert weights to a slower tier and keep ``cache`` of them per layer in
    the model's memory; returns ``model`` (changed in place; load it again to undo).

    Args:
        cache: experts kept per layer: an int in [1, E - 1], or a fraction in (0, 1) of each layer's E.
        store: the directory of the disk tier's files (one per layer; reused when they hold these
            weights, rebuilt when incomplete or stale).
        tier: ``"disk"`` (default for a cache on the CPU: each fetch reads the disk, not the page
            cache) or ``"memory"`` (default on a GPU: experts in host memory, fetched over the bus).
        device: where the cache lives and the experts compute (default: where the experts' weights
            are). A model too large for its GPU loads with its experts on the CPU (transformers'
            ``device_map``) and takes ``device="cuda"`` here: only the cache is then on the GPU.

    Call it before ``sere_fx.transform``, which then routes with each layer's resident set in view.
    """
    if getattr(model, "sere_settings", None) is not None:  # what transform records on a model (restore removes it)
        raise argument_error("model", "model: already transformed; call sere_fx.offload before sere_fx.transform "
                                      "(the routers read the cache's resident set)")
    blocks = find_moe_blocks(model)
    if any(isinstance(b.experts, OffloadedExperts) for b in blocks):
        raise argument_error("model", "model: its experts are offloaded already; load the model again to change the cache")
    sizes = {b.index: cache_size(cache, b.num_experts) for b in blocks}
    for b in blocks:
        if not standard_layout(b.experts):
            raise argument_error("model", f"model: {b.name}.experts ({type(b.experts).__name__}) is not in the fused "
                                          "layout offload reads (gate_up_proj [E, 2I, H], down_proj [E, H, I], no bias)")
    device = blocks[0].experts.gate_up_proj.device if device is None else torch.device(device)
    if tier is None:
        tier = "memory" if device.type == "cuda" else "disk"
    if tier not in TIERS:
        raise argument_error("tier", f"tier: expected one of {list(TIERS)}, got {tier!r}")
    if tier == "disk" and store is None:
        raise argument_error("store", "store: the disk tier needs a directory for the expert files, got None")
    for b in tqdm(blocks, desc="offload experts", unit="layer", disable=not progress, leave=False):
        tensors = expert_tensors(b.experts)
        slow = (open_disk_store(store, f"layer{b.index}", tensors, log=_log) if tier == "disk"
                else MemoryStore(tensors))
        layer_cache = ExpertCache(slow, sizes[b.index], tensors, device)
        setattr(b.block, "experts", OffloadedExperts(b.experts, layer_cache))
    return model


def offloaded_layers(model: nn.Module) -> dict[int, ExpertCache]:
    """``{decoder_layer_index: ExpertCache}`` of an offloaded model (empty when it is not offloaded)."""
    return {b.index: b.experts.cache for b in find_moe_blocks(model) if isinstance(b.experts, OffloadedExperts)}


def is_offloaded(model: nn.Module) -> bool:
    return bool(offloaded_layers(model))


def cache_stats(model: nn.Module) -> dict[int, CacheCounters]:
    """``{decoder_layer_index: CacheCounters}`` of an offloaded model."""
    caches = offloaded_layers(model)
    if not caches:
        raise argument_error("model", "model: not offloaded; call sere_fx.offload(model, cache, store) first")
    return {i: c.counters for i, c in caches.items()}


def reset_caches(model: nn.Module) -> None:
    """Empty every layer's cache and zero its counters."""
    for c in offloaded_layers(model).values():
        c.reset()


class counting:
    """Context manager: the caches count hits and misses only inside it when ``enabled`` (prefill
    outside it still fills them, as it would in serving)."""

    def __init__(self, model: nn.Module, enabled: bool):
        self.caches = list(offloaded_layers(model).values())
        self.enabled = enabled

    def __enter__(self):
        self._prev = [c.counting for c in self.caches]
        for c in self.caches:
            c.counting = self.enabled
        return self

    def __exit__(self, *exc):
        for c, prev in zip(self.caches, self._prev):
            c.counting = prev
