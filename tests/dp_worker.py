"""One data-parallel rank for ``test_vllm_dp.py``: the routing step on this rank's rows, the ranks
agreeing on one loaded set through a gloo all-reduce. Writes (weights, ids) per policy."""

import sys

import torch
import torch.distributed as dist

from dp_case import PLANS, RANKS, batch, rows_of, step

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
calls = []


def reduce(values: torch.Tensor) -> torch.Tensor:
    calls.append(values.numel())
    values = values.clone()
    dist.all_reduce(values)
    return values


logits, sim = batch()
start = sum(rows_of(r) for r in RANKS[:rank])
mine = logits[start : start + rows_of(RANKS[rank])]
results = {policy: step(policy, RANKS[rank], mine, sim, reduce)[:2] for policy in PLANS}
torch.save({"results": results, "calls": calls}, out)
dist.destroy_process_group()
