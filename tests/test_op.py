"""``torch.ops.sere.reroute``: PyTorch and Triton implementations against the plain-loop reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sere_fx
from reference import engine_reroute_loop, reroute_loop, reroute_rows_loop
from sere_fx import ops
from sere_fx.kernels import reroute_triton
from sere_fx.policies import remap_ids

reroute = torch.ops.sere.reroute

needs_triton = pytest.mark.skipif(not reroute_triton.AVAILABLE, reason="triton not installed")


@st.composite
def cases(draw):
    E = draw(st.integers(2, 48))
    K = draw(st.integers(1, min(E, 8)))
    T = draw(st.integers(1, 40))
    S = draw(st.integers(1, K + 1))  # K + 1: S > K is also the identity
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    levels = draw(st.sampled_from([0, 2, 4, 1000]))  # few levels -> many ties
    sim = torch.rand(E, E, generator=g) * 2 - 0.5  # outside [0, 1] too: the op must not care
    if levels:
        sim = torch.round(sim * levels) / levels
    rho = draw(st.sampled_from([0.0, -0.3, 0.25, 0.5, 0.9, float(sim.median())]))
    return ids, sim, S, rho


@settings(max_examples=150, deadline=None)
@given(cases())
def test_op_matches_loop_reference(case):  # the C CPU kernel, eagerly
    ids, sim, S, rho = case
    before = ids.clone()
    out = reroute(ids, sim, S, rho)
    assert torch.equal(ids, before), "input mutated"
    assert out.dtype == torch.int64 and out.shape == ids.shape
    assert torch.equal(out, reroute_loop(ids, sim, S, rho))


@settings(max_examples=100, deadline=None)
@given(cases())
def test_aten_matches_loop_reference(case):  # what compilers and exporters inline
    ids, sim, S, rho = case
    assert torch.equal(ops.reroute_aten(ids, sim, S, rho), reroute_loop(ids, sim, S, rho))


def test_cpu_kernel_is_built_and_takes_int32_ids():
    # CI machines have a C compiler (Inductor needs one on the CPU too): the fast path must be there
    from sere_fx.kernels import reroute_cpu

    assert reroute_cpu.available()
    g = torch.Generator().manual_seed(1)
    sim = torch.rand(40, 40, generator=g)
    ids = torch.tensor([[39, 1, 2, 3], [39, 5, 6, 7]])  # one primary expert at S=1: far down most rows' order
    values = torch.rand(ids.shape, generator=g)
    for rho in (0.0, 0.5):
        expected = reroute_loop(ids, sim, 1, rho)
        assert torch.equal(reroute_cpu.reroute(ids, sim, 1, rho), expected)
        assert torch.equal(reroute_cpu.reroute(ids.int(), sim, 1, rho), expected.int())
        ranked = engine_reroute_loop(ids, values, torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool),
                                     sim, 2, rho)
        assert torch.equal(reroute_cpu.reroute(ids.int(), sim.double(), 2, rho, values), ranked.int())


def test_cpu_kernel_sees_in_place_updates_of_the_similarity():
    sim = torch.eye(4)
    sim[1, 0] = 0.9
    ids = torch.tensor([[0, 1], [2, 3]])
    assert reroute(ids, sim, 1, 0.5).tolist() == [[0, 0], [2, 3]]
    sim[1, 0], sim[1, 2] = 0.1, 0.9  # same tensor, new values: the cached candidates must not be reused
    assert reroute(ids, sim, 1, 0.5).tolist() == [[0, 2], [2, 3]]


@needs_triton
@settings(max_examples=60, deadline=None)
@given(cases())
def test_triton_matches_aten(case):
    ids, sim, S, rho = case
    with ops.use_triton():
        out = reroute(ids, sim, S, rho)
    assert torch.equal(out, reroute_loop(ids, sim, S, rho))


@needs_triton
@pytest.mark.parametrize("E,K,T", [(128, 8, 64), (256, 8, 3), (60, 4, 33)])
def test_triton_real_sizes(E, K, T):
    g = torch.Generator().manual_seed(E + T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    sim = torch.rand(E, E, generator=g)
    for S, rho in [(1, 0.0), (2, 0.5), (K // 2, 0.3)]:
        with ops.use_triton():
            tri = reroute(ids, sim, S, rho)
        assert torch.equal(tri, ops.reroute_aten(ids, sim, S, rho))


def _ids(rows):
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("impl", ["aten", pytest.param("triton", marks=needs_triton)])
class TestEdgeCases:
    def call(self, impl, *args):
        with ops.use_triton(impl == "triton"):
            return reroute(*args)

    def test_single_token(self, impl):
        sim = torch.eye(6)
        sim[3, 1] = 0.9
        out = self.call(impl, _ids([[1, 3, 5]]), sim, 1, 0.5)
        # primary = {1}; 3 -> 1 (0.9 >= 0.5); 5 best is 1 with 0.0 < 0.5: critical, kept
        assert out.tolist() == [[1, 1, 5]]

    def test_S_equal_K_is_identity(self, impl):
        ids = _ids([[0, 1, 2], [3, 4, 5]])
        sim = torch.rand(6, 6)
        assert torch.equal(self.call(impl, ids, sim, 3, 0.0), ids)

    def test_all_critical(self, impl):
        ids = _ids([[0, 1, 2], [3, 4, 5]])
        sim = torch.full((6, 6), 0.2).fill_diagonal_(1.0)
        assert torch.equal(self.call(impl, ids, sim, 1, 0.5), ids)

    def test_all_primary(self, impl):
        # every secondary expert is some other token's primary: nothing moves
        ids = _ids([[0, 1], [1, 0]])
        assert torch.equal(self.call(impl, ids, torch.zeros(4, 4), 1, 0.0), ids)

    def test_ties_take_lowest_index(self, impl):
        sim = torch.zeros(8, 8)
        sim[7, 2] = sim[7, 5] = sim[7, 4] = 0.6
        out = self.call(impl, _ids([[5, 7], [2, 1], [4, 0]]), sim, 1, 0.5)
        assert out[0, 1] == 2

    def test_duplicates_after_rerouting(self, impl):
        # two secondaries of one token land on the same primary expert: allowed
        sim = torch.eye(5)
        sim[2, 0] = sim[3, 0] = 0.8
        out = self.call(impl, _ids([[0, 2, 3]]), sim, 1, 0.5)
        assert out.tolist() == [[0, 0, 0]]

    def test_rho_zero_reroutes_everything(self, impl):
        sim = torch.full((6, 6), -5.0).fill_diagonal_(1.0)
        out = self.call(impl, _ids([[0, 4], [1, 5]]), sim, 1, 0.0)
        assert set(out.flatten().tolist()) <= {0, 1}

    def test_empty_batch(self, impl):
        ids = torch.empty(0, 4, dtype=torch.int64)
        assert self.call(impl, ids, torch.rand(8, 8), 2, 0.5).shape == (0, 4)


def test_rho_is_compared_in_float32():
    # 0.3 is not representable: a float64 comparison would call 0.3f critical at rho=0.3
    sim = torch.eye(3)
    sim[2, 0] = 0.3
    out = reroute(_ids([[0, 2]]), sim, 1, 0.3)
    assert out.tolist() == [[0, 0]]


def test_opcheck():
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(64, generator=g)[:8] for _ in range(16)])
    sim = torch.rand(64, 64, generator=g)
    for S, rho in [(2, 0.5), (8, 0.0), (1, 0.0)]:
        torch.library.opcheck(reroute.default, (ids, sim, S, rho))


def test_decomposition_matches_op():
    table = ops.decompositions()
    assert set(table) == {reroute.default}
    ids = _ids([[0, 3, 5], [1, 2, 4]])
    sim = torch.rand(6, 6)
    assert torch.equal(table[reroute.default](ids, sim, 1, 0.4), reroute(ids, sim, 1, 0.4))


@pytest.mark.parametrize(
    "ids,sim,S,match",
    [
        (torch.zeros(4, dtype=torch.int64), torch.rand(4, 4), 1, "topk_ids: expected a 2-D"),
        (torch.zeros(2, 2, dtype=torch.int16), torch.rand(4, 4), 1, "topk_ids: expected dtype torch.int64 or torch.int32"),
        (torch.zeros(2, 2, dtype=torch.int64), torch.rand(4, 3), 1, "similarity: expected a square"),
        (torch.zeros(2, 2, dtype=torch.int64), torch.ones(4, 4, dtype=torch.int64), 1, "similarity: expected a floating"),
        (torch.zeros(2, 2, dtype=torch.int64), torch.rand(4, 4), 0, "S: expected an integer >= 1, got 0"),
    ],
)
def test_bad_inputs(ids, sim, S, match):
    with pytest.raises(RuntimeError, match=match):
        reroute(ids, sim, S, 0.5)


def test_remap_ids_restores_unsorted_slot_order():
    from reference import reroute_unsorted_loop

    g = torch.Generator().manual_seed(3)
    values = torch.rand(10, 4, generator=g)
    ids = torch.stack([torch.randperm(12, generator=g)[:4] for _ in range(10)])
    sim = torch.rand(12, 12, generator=g)
    out = remap_ids(ids, values, sim, S=2, rho=0.4)
    assert torch.equal(out, reroute_unsorted_loop(ids, values, sim, 2, 0.4))
    # leading batch dims are flattened into tokens and restored
    out3 = remap_ids(ids.view(2, 5, 4), values.view(2, 5, 4), sim, S=2, rho=0.4)
    assert torch.equal(out3.view(10, 4), out)


def test_remap_ids_leaves_prefill_untouched():
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(12, generator=g)[:4] for _ in range(10)])
    sim = torch.zeros(12, 12)
    assert torch.equal(remap_ids(ids, None, sim, S=1, rho=0.0, max_tokens=9), ids)
    assert not torch.equal(remap_ids(ids, None, sim, S=1, rho=0.0, max_tokens=10), ids)


def test_public_api_names_the_functions_not_shadowed_modules():
    import importlib
    import inspect

    for name in sere_fx.__all__:
        assert getattr(sere_fx, name) is not None, name
    # sere_fx.transform / sere_fx.tune are the functions; their modules have names of their own
    assert sere_fx.transform is importlib.import_module("sere_fx.model_transform").transform
    assert sere_fx.tune is importlib.import_module("sere_fx.tuning").tune
    for shadowed in ("sere_fx.transform", "sere_fx.tune"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(shadowed)
    # the documented default is the one the entry points use
    for fn in (sere_fx.transform, sere_fx.backend):
        assert inspect.signature(fn).parameters["max_tokens"].default == sere_fx.DEFAULT_MAX_TOKENS


@st.composite
def engine_cases(draw):
    """Unsorted int32 slots with rank values (ties included) and a mask of valid rows."""
    ids, sim, S, rho = draw(cases())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    values = torch.round(torch.rand(ids.shape, generator=g) * draw(st.sampled_from([3, 1000])))
    valid = torch.rand(ids.shape[0], generator=g) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    return ids.to(torch.int32), values, valid, sim, S, rho


@settings(max_examples=150, deadline=None)
@given(engine_cases())
def test_rank_values_and_valid_rows_match_loop_reference(case):
    ids, values, valid, sim, S, rho = case
    expected = reroute_rows_loop(ids, values, valid, sim, S, rho)
    out = reroute(ids, sim, S, rho, values, valid)
    assert out.dtype == torch.int32 and out.shape == ids.shape
    assert torch.equal(out, expected)
    assert torch.equal(ops.reroute_aten(ids, sim, S, rho, values, valid), expected)


@needs_triton
@settings(max_examples=60, deadline=None)
@given(engine_cases())
def test_triton_rank_values_and_valid_rows(case):
    ids, values, valid, sim, S, rho = case
    with ops.use_triton():
        out = reroute(ids, sim, S, rho, values, valid)
    assert torch.equal(out, reroute_rows_loop(ids, values, valid, sim, S, rho))


@st.composite
def free_row_cases(draw):
    """Engine cases with free rows and, now and then, ids outside [0, E) (padding -1, ids >= E)."""
    ids, values, valid, sim, S, rho = draw(engine_cases())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    free = torch.rand(ids.shape[0], generator=g) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    if draw(st.booleans()):
        e = sim.shape[0]
        odd = torch.rand(ids.shape, generator=g) < 0.2
        ids = torch.where(odd, torch.where(torch.rand(ids.shape, generator=g) < 0.5, -1, e + 2), ids).to(ids.dtype)
    return ids, values, valid, free, sim, S, rho


@settings(max_examples=150, deadline=None)
@given(free_row_cases())
def test_free_rows_and_ids_outside_the_experts_match_loop_reference(case):
    ids, values, valid, free, sim, S, rho = case
    expected = engine_reroute_loop(ids, values, valid, free, sim, S, rho)
    assert torch.equal(reroute(ids, sim, S, rho, values, valid, free), expected)  # C kernel
    assert torch.equal(ops.reroute_aten(ids, sim, S, rho, values, valid, free), expected)
    if not free.any():  # without free rows: the documented rule of valid rows alone
        assert torch.equal(reroute(ids, sim, S, rho, values, valid), expected)


@needs_triton
@settings(max_examples=60, deadline=None)
@given(free_row_cases())
def test_triton_free_rows_and_ids_outside_the_experts(case):
    ids, values, valid, free, sim, S, rho = case
    with ops.use_triton():
        out = reroute(ids, sim, S, rho, values, valid, free)
    assert torch.equal(out, engine_reroute_loop(ids, values, valid, free, sim, S, rho))


@needs_triton
@pytest.mark.parametrize("valid_share", [0.0, 0.3, 1.0])
def test_triton_prefill_sized_steps(valid_share):
    # 300 rows: ten programs in the row and slot phases, five in the expert phase (E = 160); each
    # row's two best-ranked slots hold experts < 20, so there is something to re-route; a step with
    # no valid row must come back unchanged, whatever its free rows hold
    g = torch.Generator().manual_seed(7)
    E, K, T = 160, 8, 300
    ids = torch.stack([torch.cat([torch.randperm(20, generator=g)[:2], 20 + torch.randperm(E - 20, generator=g)[:K - 2]])
                       for _ in range(T)]).to(torch.int32)
    ids[torch.rand(ids.shape, generator=g) < 0.03] = -1
    values = torch.linspace(1.0, 0.1, K).repeat(T, 1)[:, torch.randperm(K, generator=g)]
    ids = ids.gather(1, values.argsort(dim=1, descending=True).argsort(dim=1))  # best-ranked slots hold the < 20s
    valid = torch.rand(T, generator=g) < valid_share
    free = ~valid & (torch.rand(T, generator=g) < 0.01)
    sim = torch.rand(E, E, generator=g)
    for rho in (0.0, 0.4):
        with ops.use_triton():
            out = reroute(ids, sim, 2, rho, values, valid, free)
        assert torch.equal(out, engine_reroute_loop(ids, values, valid, free, sim, 2, rho))
        assert torch.equal(out, ids) == (not valid.any())


def test_free_rows_add_primaries_for_the_others():
    # row 0 re-routes; row 1 is a prompt row whose experts are read anyway
    sim = torch.tensor([[1.0, 0.9, 0.2, 0.1], [0.9, 1.0, 0.1, 0.2], [0.2, 0.1, 1.0, 0.8], [0.1, 0.2, 0.8, 1.0]])
    ids = torch.tensor([[0, 3], [2, 1]])
    values = torch.tensor([[2.0, 1.0], [2.0, 1.0]])
    valid = torch.tensor([True, False])
    assert reroute(ids, sim, 1, 0.0, values, valid).tolist() == [[0, 0], [2, 1]]  # 3 -> the only primary, 0
    free = torch.tensor([False, True])
    assert reroute(ids, sim, 1, 0.0, values, valid, free).tolist() == [[0, 2], [2, 1]]  # 3 -> 2, loaded anyway


def test_rank_values_and_valid_rows_are_checked():
    ids = torch.zeros(4, 3, dtype=torch.int32)
    sim = torch.eye(5)
    with pytest.raises(RuntimeError, match=r"rank_values: expected shape \(4, 3\)"):
        reroute(ids, sim, 1, 0.0, torch.zeros(4, 2), None)
    with pytest.raises(RuntimeError, match=r"valid_rows: expected a bool \[4\] tensor"):
        reroute(ids, sim, 1, 0.0, None, torch.ones(3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"free_rows: expected a bool \[4\] tensor"):
        reroute(ids, sim, 1, 0.0, None, None, torch.ones(4, dtype=torch.int32))
