"""Prefix reuse for scoring passes: a plan that leaves the layers before decoder layer i as the model
routes them computes, up to layer i, exactly what the baseline pass computed on the same windows.
``tune`` probes one layer at a time, so most of its passes have such a prefix: the baseline pass records
each MoE decoder layer's input per forward, and a later pass of the same windows starts its forwards at
the first layer it changes (the layers before it hand on the recorded input instead of computing).

The first layer a pass computes also gets the baseline's input, so its attention would compute what the
baseline's did: the baseline records that attention's output too, and the pass hands it on instead (the
plan changes only the layer's experts, after the attention).

Only the whole-window forwards of ``decode_scores(parallel=True)`` are reused: they have no KV cache, so
a decoder layer's input is all the later layers read of the earlier ones.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn

from sere_fx.discovery import find_moe_blocks

# Recorded inputs above this size are thinned (every m-th MoE layer kept): a 30B model's 48 layers of
# 128 windows x 101 tokens x 2048 are 5 GB in bf16.
MAX_BYTES = 2 << 30

_DECODER_LAYER = re.compile(r"^(.*?)(?:^|\.)layers\.(\d+)(?:\.|$)")

# What a decoder layer calls its attention module, as the transformers families spell it.
_ATTENTION_NAMES = ("self_attn", "attention", "attn", "self_attention")


def attention_of(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's attention submodule, or None where it has none by one of ``_ATTENTION_NAMES``."""
    for name in _ATTENTION_NAMES:
        child = getattr(layer, name, None)
        if isinstance(child, nn.Module):
            return child
    return None


def decoder_stack(model: nn.Module) -> tuple[nn.ModuleList, dict[int, int]] | None:
    """The decoder layers' ``ModuleList`` and, per MoE layer index, its position in it; None where the
    MoE blocks do not sit in one ``...layers.<i>`` list (then nothing is reused)."""
    lists, where = set(), {}
    for block in find_moe_blocks(model):
        match = _DECODER_LAYER.match(block.name)
        if match is None:
            return None
        lists.add(f"{match.group(1)}.layers" if match.group(1) else "layers")
        where[block.index] = int(match.group(2))
    if len(lists) != 1:
        return None
    stack = model.get_submodule(lists.pop())
    if not isinstance(stack, nn.ModuleList) or max(where.values()) >= len(stack):
        return None
    return stack, where


class PrefixRecord:
    """One baseline pass's inputs to the MoE decoder layers, per forward (``record``), replayed by a
    later pass of the same windows from a chosen layer on (``replay``)."""

    def __init__(self, model: nn.Module, rows: int, length: int, max_bytes: int = MAX_BYTES):
        found = decoder_stack(model)
        self.stack, where = found if found is not None else (None, {})
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        dtype = next(model.parameters()).dtype
        starts = sorted(set(where.values()) - {0})  # a pass that changes decoder layer 0 reuses nothing
        if hidden and starts:
            # each start keeps its input and its attention's output; decoder layer 0 its attention's output
            per_layer = rows * length * hidden * torch.empty((), dtype=dtype).element_size()
            every = max(1, -(-per_layer * (2 * len(starts) + 1) // max_bytes))
            starts = starts[every - 1 :: every]
        self.moe_position = where  # MoE layer index -> decoder-layer position
        self.starts = starts  # none without a decoder stack
        self.inputs: dict[int, list[torch.Tensor]] = {p: [] for p in self.starts}
        # the attention outputs of the layers a pass can start at (0 too), where each layer has one attention
        attends = [0, *self.starts] if self.stack is not None and where else []
        self.attention = {p: [] for p in attends if attention_of(self.stack[p]) is not None}
        self.complete = False  # the inputs handed on: passes may start at a later layer
        self.attention_complete = False  # the attention outputs kept: a pass's first layer may skip its attention

    def start_for(self, first_changed: int | None) -> int:
        """The deepest recorded position at or before MoE layer ``first_changed`` (None: the plan
        changes no layer); 0 when nothing recorded lies before it."""
        if not self.complete:
            return 0
        limit = len(self.stack) if first_changed is None else self.moe_position.get(first_changed, 0)
        return max((p for p in self.starts if p <= limit), default=0)

    @contextlib.contextmanager
    def record(self):
        """Record each start layer's input and the attention outputs, one tensor per forward, during the
        baseline pass."""
        handles, handed_on, attended = [], [], []

        def keep(position):
            def hook(module, args, kwargs):
                hidden = args[0] if args else kwargs.get("hidden_states")
                handed_on.append(isinstance(hidden, torch.Tensor))
                if handed_on[-1]:  # a copy: a layer may add to its input in place
                    self.inputs[position].append(hidden.detach().clone())
            return hook

        def returns_tensor(module, args, output):  # what a skipped layer hands on must be what it returns
            handed_on.append(isinstance(output, torch.Tensor))

        def keep_attention(position):
            def hook(module, args, output):
                # replayed as ``(output, None)``: only an attention that returns no weights (nor a cache) is kept
                attended.append(isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor)
                                and output[1] is None)
                if attended[-1]:
                    self.attention[position].append(output[0].detach().clone())
            return hook

        try:
            for p in self.starts:
                handles.append(self.stack[p].register_forward_pre_hook(keep(p), with_kwargs=True))
                handles.append(self.stack[p - 1].register_forward_hook(returns_tensor))
            for p in self.attention:
                handles.append(attention_of(self.stack[p]).register_forward_hook(keep_attention(p)))
            yield self
            self.complete = bool(self.starts) and all(handed_on)
            forwards = {len(kept) for kept in self.attention.values()}
            self.attention_complete = bool(self.attention) and all(attended) and len(forwards) == 1
            if not self.attention_complete:
                self.attention = {p: [] for p in self.attention}  # nothing to replay: the memory back
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def replay(self, start: int):
        """Decoder layers before position ``start`` hand on the recorded input of ``start`` (the k-th
        forward gets the baseline's k-th) instead of computing, and the attention of layer ``start`` hands
        on the baseline's output (where recorded); ``start`` 0 with no attention recorded: nothing changes."""
        recorded, forwards = self.inputs.get(start, []), [0]
        attended = self.attention.get(start) if self.attention_complete else None
        attention, attention_calls = attention_of(self.stack[start]) if attended else None, [0]

        def skip(position):
            def forward(hidden_states, *args, **kwargs):
                if position == 0:
                    forwards[0] += 1
                kept = recorded[forwards[0] - 1]
                return kept.clone() if position == start - 1 else kept  # later layers may write to it
            return forward

        def attend(*args, **kwargs):  # the input is the baseline's: so is what the attention returns
            attention_calls[0] += 1
            return attended[attention_calls[0] - 1].clone(), None  # the layer may add to it in place

        try:
            for p in range(start):
                self.stack[p].forward = skip(p)
            if attention is not None:
                attention.forward = attend
            yield
        finally:
            for p in range(start):
                del self.stack[p].forward  # the class's forward again
            if attention is not None:
                del attention.forward
