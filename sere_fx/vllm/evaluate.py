"""Evaluation inside vLLM: ``sere-fx eval`` as real decode steps of the engine that serves the model.

The protocol is the transformers ``eval``'s (``sere_fx.evaluate.decode_scores``): each window's
first ``prefill`` tokens are its prompt, and then the B sequences of a batch advance one
*reference* token per step, every step a decode step of the engine with all B rows in it. A
logits processor (``TeacherForcing``, given each request's reference continuation in
``extra_args``) lets only the reference token be sampled; vLLM's logprobs are taken from the raw
logits, before any processor, so each step returns the model's own log-probability of the
reference token and its rank (rank 1: the model's top-1). The first sampled token comes from the
prompt's prefill and is not scored, as in the transformers path. Distinct experts per layer per
decode step come from the plugin's counters (``routing_stats``).

Every policy runs in the same engine: between passes the workers switch the plugin's per-layer
configs (``switch_routing``), which needs an eager engine (``enforce_eager=True``: a compiled
graph would keep the configs it was traced with). The baseline is the model's own routing with
the counters on (each layer's ``topk`` at S = K, which routes as the model does).
"""

from __future__ import annotations

import math
import uuid

import numpy as np
import torch

from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from sere_fx.config import Quantile
from sere_fx.errors import ArgumentTypeError, ArgumentValueError
from sere_fx.vllm.siblings import GROUP_KEY

# extra_args key of each request's reference continuation (the tokens after its prompt)
REFERENCE_KEY = "sere_reference"


class TeacherForcing(AdapterLogitsProcessor):
    """Only the request's next reference token can be sampled (requests without a reference are
    left alone); its logit is kept as it was, so the sampled token's raw logprob is the model's."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        reference = (params.extra_args or {}).get(REFERENCE_KEY)
        if reference is None:
            return None

        def force(output_ids, logits):
            token = reference[min(len(output_ids), len(reference) - 1)]
            keep = logits[token].clone()
            logits.fill_(float("-inf"))
            logits[token] = keep
            return logits

        return force


LOGITS_PROCESSOR = "sere_fx.vllm.evaluate:TeacherForcing"


def baseline_settings(layers) -> dict:
    """The model's own routing, counted: ``topk`` at S = K on every layer."""
    return {"policy": "topk", "S": {str(layer.index): layer.top_k for layer in layers}, "stats": True}


def spec_settings(spec, sim: str | None) -> dict:
    """``additional_config["sere"]`` for an eval spec (``sere_fx.evaluate.PolicySpec``)."""
    raw = {}
    for key, value in spec.kwargs.items():
        if key == "rank_budget":
            raise ArgumentValueError("policy", f"policy: {spec.label!r}: a per-rank budget (Nrank=) reaches the engine "
                                               "through a plan file (plan:PATH), not as a spec")
        raw[key] = {"quantile": value.q} if isinstance(value, Quantile) else value
    if sim is not None:
        raw["sim"] = sim
    return {**raw, "stats": True}


def _decode_pass(llm, windows: torch.Tensor, batch_size: int, prefill: int, progress: bool):
    """One pass over ``windows`` in batches of ``batch_size``: per sequence (correct, nll)."""
    from vllm import SamplingParams

    n, length = windows.shape
    correct = np.zeros(n, dtype=np.int64)
    nll = np.zeros(n, dtype=np.float64)
    run = uuid.uuid4().hex[:8]
    for start in range(0, n, batch_size):
        batch = windows[start:start + batch_size].tolist()
        prompts = [{"prompt_token_ids": row[:prefill]} for row in batch]
        # one group: the engine admits the batch's B requests together, so all B prefill in one step
        # and decode in lockstep, however their messages reach the engine core
        group = {"group": f"sere-eval-{run}-{start}", "size": len(batch)}
        params = [SamplingParams(max_tokens=length - prefill, temperature=0.0, logprobs=0, ignore_eos=True,
                                 detokenize=False, extra_args={REFERENCE_KEY: row[prefill:], GROUP_KEY: group})
                  for row in batch]
        outputs = llm.generate(prompts, params, use_tqdm=progress)
        for i, (row, out) in enumerate(zip(batch, outputs)):
            sample = out.outputs[0]
            if list(sample.token_ids) != row[prefill:]:
                raise RuntimeError(f"evaluation: sequence {start + i} did not follow its reference tokens")
            # the first token comes from the prefill: not scored
            for token, step in zip(sample.token_ids[1:], sample.logprobs[1:]):
                lp = step[token]  # the reference token's raw logprob and rank
                nll[start + i] -= lp.logprob
                correct[start + i] += int(lp.rank == 1)
    return correct, nll


def _checked_engine(llm, windows: torch.Tensor, batch_size: int, prefill: int):
    """The engine's MoE layers, after refusing what the teacher-forced passes cannot run on."""
    from sere_fx.vllm.startup import model_layers

    if not isinstance(windows, torch.Tensor) or windows.dim() != 2:
        raise ArgumentTypeError("windows", f"windows: expected token ids [N, L], got {getattr(windows, 'shape', windows)}")
    n, length = windows.shape
    if not 1 <= prefill < length - 1:
        raise ArgumentValueError("prefill", f"prefill: expected an int in [1, {length - 2}] for windows of {length} "
                                            f"tokens, got {prefill}")
    if not isinstance(batch_size, int) or not 1 <= batch_size <= n:
        raise ArgumentValueError("batch_size", f"batch_size: expected an int in [1, {n}] (the number of sequences), "
                                               f"got {batch_size!r}")
    config = llm.llm_engine.vllm_config
    if not config.model_config.enforce_eager:
        raise ArgumentValueError("llm", "llm: expected an engine started with enforce_eager=True (the policies are "
                                        "switched between passes; a compiled graph keeps the ones it was traced with)")
    scheduler = config.scheduler_config
    if scheduler.max_num_seqs < batch_size or scheduler.max_num_batched_tokens < batch_size * prefill:
        raise ArgumentValueError("llm", f"llm: expected max_num_seqs >= {batch_size} and max_num_batched_tokens >= "
                                        f"{batch_size * prefill} (a batch's prompts in one step, then {batch_size} "
                                        f"decode rows per step), got {scheduler.max_num_seqs} and "
                                        f"{scheduler.max_num_batched_tokens}")
    layers = model_layers(config.model_config.hf_config)
    if layers is None:
        raise ArgumentValueError("llm", "llm: cannot tell the served model's MoE layers from its config")
    return layers


def engine_scores(llm, windows: torch.Tensor, raw: dict | None, *, batch_size: int, prefill: int,
                  progress: bool = False):
    """``DecodeScores`` of one pass with the plugin's settings ``raw`` on every worker."""
    import sere_fx.vllm
    from sere_fx.evaluate import DecodeScores

    llm.collective_rpc("sere_switch_routing", args=(raw,))
    try:
        correct, nll = _decode_pass(llm, windows, batch_size, prefill, progress)
        stats = sere_fx.vllm.routing_stats(llm)
    finally:
        llm.collective_rpc("sere_switch_routing", args=(None,))
    tokens = np.full(windows.shape[0], windows.shape[1] - prefill - 1, dtype=np.int64)
    return DecodeScores(correct, nll, tokens, {layer: values["distinct_after"] for layer, values in stats.items()})


class EngineScorer:
    """``sere_fx.tuning.tune``'s scorer inside a vLLM engine: a plan is handed to the workers as a
    plan file (``additional_config["sere"]["plan"]``), switched in without restarting the engine."""

    def __init__(self, llm, sim: str, scratch: str, *, batch_size: int, prefill: int, windows: torch.Tensor):
        self.llm, self.sim, self.scratch = llm, sim, scratch
        self.batch_size, self.prefill = batch_size, prefill
        self.layers = _checked_engine(llm, windows, batch_size, prefill)

    def __call__(self, plan, windows: torch.Tensor):
        import os

        from sere_fx.plan import save_plan

        if plan is None:
            raw = baseline_settings(self.layers)
        else:
            path = os.path.join(self.scratch, "probe.plan.json")
            save_plan(path, plan)
            raw = {"plan": path, "sim": self.sim, "stats": True}
        return engine_scores(self.llm, windows[: windows.shape[0] - windows.shape[0] % self.batch_size], raw,
                             batch_size=self.batch_size, prefill=self.prefill)


def evaluate_engine(llm, windows: torch.Tensor, policies, sim: str | None = None, *, batch_size: int = 32,
                    prefill: int = 4, progress: bool = True):
    """``sere_fx.evaluate.evaluate`` inside the vLLM engine ``llm`` (started with
    ``enforce_eager=True`` and ``logits_processors=[LOGITS_PROCESSOR]``); ``sim``: the similarity
    file's path, for the policies that read one. Returns the same ``EvalReport``."""
    from sere_fx.evaluate import build_report, parse_policy

    specs = [p if not isinstance(p, str) else parse_policy(p) for p in policies if p != "baseline"]
    layers = _checked_engine(llm, windows, batch_size, prefill)
    n, length = windows.shape
    windows = windows[: n - n % batch_size]  # every scored step carries exactly batch_size rows
    scored = []
    for label, raw in [("baseline", baseline_settings(layers)), *((s.label, spec_settings(s, sim)) for s in specs)]:
        s = engine_scores(llm, windows, raw, batch_size=batch_size, prefill=prefill, progress=progress)
        scored.append((label, s, None if label == "baseline" else raw))
    report = build_report(scored, {"batch_size": batch_size, "prefill": prefill, "sequences": int(windows.shape[0]),
                                   "dropped_sequences": n % batch_size, "window": int(length),
                                   "scored_tokens": int(scored[0][1].tokens.sum()), "max_tokens": None,
                                   "engine": "vllm"})
    if not all(math.isfinite(r.nll) for r in report.results):
        raise RuntimeError("evaluation: a policy scored a non-finite NLL")
    return report
