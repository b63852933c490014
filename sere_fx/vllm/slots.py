"""Exact slot merging: fewer experts read must mean less kernel work too.

After re-routing, a token's slots often land on one expert twice (SERE sends a secondary expert
to a primary the token already uses), and the top-k policies fill slots they cannot fill with
weight-0 copies of the token's first expert. A kernel that computes every slot does that
expert's work twice, or work that is multiplied by 0. Merging a token's slots of one expert
into one slot with the summed weight, and skipping weight-0 slots, gives the same output up to
rounding (``kernels/engine_op.cpp``, ``merge_slots``).

How each of vLLM's kernels can skip a slot decides where that happens:

- vLLM's CPU fused-MoE kernel (``_C.cpu_fused_moe``, the experts class ``CPUUnquantizedExperts``
  and its ISA subclasses) computes every slot, and an id of -1 (how expert parallelism marks
  other ranks' experts) would index out of its bounds. The plugin swaps the experts object's
  class for a subclass whose ``apply`` calls ``torch.ops.sere_native.fused_moe``: the same
  kernel over each token's distinct experts (pseudo-tokens of top-1), in steps that carry only
  re-routed rows; steps with prompt rows, and calls with nothing to merge, run vLLM's call
  unchanged.
- Every other experts kernel (the Triton and modular kernels on GPUs, ZenDNN, quantized CPU
  kernels) is left alone, and the log says once that it computes every slot. (vLLM's CUDA
  ``moe_align_block_size`` skips ids >= E but, depending on the build, not -1; marking slots for
  a kernel that has not been run here would risk wrong output, not save time.)

The routing itself is unchanged: merging is a property of the kernel, so statistics, other
front-ends and the routing rules in ``sere_fx.policies`` see the same ids and weights.
"""

from __future__ import annotations

import torch

from sere_fx.kernels import reroute_cpu

_SUBCLASSES: dict[type, type] = {}


def _cpu_experts_class():
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # pragma: no cover - depends on the vLLM build
        return None
    return CPUUnquantizedExperts


def experts_of(runner):
    """The experts object (``FusedMoEExperts``) of a ``MoERunner``'s modular kernel, or None."""
    method = getattr(runner, "_quant_method", None) or getattr(runner, "quant_method", None)
    kernel = getattr(method, "moe_kernel", None)
    return getattr(getattr(kernel, "impl", None), "fused_experts", None)


def why_not(experts) -> str | None:
    """Why ``experts`` cannot merge slots (None: it can)."""
    base = _cpu_experts_class()
    cls = getattr(type(experts), "_sere_base", type(experts))
    name = cls.__name__ if experts is not None else "this layer's MoE kernel"
    if base is None or experts is None or not isinstance(experts, base) or cls.apply is not base.apply:
        return (f"{name} computes every token-slot (slot merging runs on vLLM's CPU fused-MoE kernel, "
                "CPUUnquantizedExperts, only)")
    if getattr(experts, "_use_zentorch", False):
        return f"{name} runs ZenDNN's fused MoE, which computes every token-slot"
    if not reroute_cpu.load_engine_op():
        return "the native CPU ops could not be built"
    return None


def _merging_subclass(cls: type) -> type:
    if cls not in _SUBCLASSES:

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            # vLLM's own call, with a token's slots of one expert merged (engine_op.cpp)
            torch.ops.sere_native.fused_moe(output, hidden_states, w1, w2, self.w1_bias, self.w2_bias, topk_weights,
                                            topk_ids, apply_router_weight_on_input, activation.value, self.isa)

        _SUBCLASSES[cls] = type(f"SereMerging{cls.__name__}", (cls,), {"apply": apply, "_sere_base": cls,
                                                                        "__module__": __name__})
    return _SUBCLASSES[cls]


def install(runner) -> str | None:
    """Make ``runner``'s experts kernel merge slots; returns why it cannot (then nothing changes)."""
    experts = experts_of(runner)
    why = why_not(experts)
    if why is None:
        experts.__class__ = _merging_subclass(getattr(type(experts), "_sere_base", type(experts)))
    return why


def uninstall(runner) -> None:
    """Give ``runner``'s experts object back its own class (no-op when never installed)."""
    experts = experts_of(runner)
    base = getattr(type(experts), "_sere_base", None)
    if base is not None:
        experts.__class__ = base
