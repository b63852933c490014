"""Calibration inside a vLLM engine: the file ``calibrate`` writes, from the engine that serves the model.

``calibrate_engine(llm, windows, method)`` prefills the calibration windows through the engine
(one ``generate`` with ``max_tokens=1``: prompt processing only). Each worker has hooked the MoE
layers it holds (vLLM's ``MoERunner``): a pre-hook sees the hidden states each layer's experts
receive, real rows only (the V1 runner's ``query_start_loc`` says how many the step scheduled),
and feeds them to the same streaming accumulators as the transformers path
(``calibration.methods``, ``calibration.predictors``). Every expert's output on every token comes
from the layer's own kernel (``routed_experts.forward_modular``): the tokens repeated once per
expert, each copy routed to its expert at weight 1, one call per chunk, so whatever weight format
the engine runs, calibration runs too. A tensor-parallel rank computes a partial sum of those
outputs (its shard of the intermediate dimension) and an expert-parallel rank only its own
experts (zeros for the others): one all-reduce over the tensor-parallel group gives every rank
the full outputs, as the layer's forward does. Workers finalise their layers (CKA evaluates its
token sample there, in step across ranks); the driver takes each layer from the first worker
that holds it (pipeline stages hold different layers) and builds the ``Similarity``.

The engine must run eagerly (``enforce_eager=True``: a compiled graph does not call module
hooks), without prefix caching (cached prompt blocks are not computed, so their tokens would be
missing: counted and refused) and with one data-parallel rank.
"""

from __future__ import annotations

import torch

from sere_fx.calibration.methods import DEFAULT_CKA_SAMPLE, METHODS, accumulator
from sere_fx.calibration.predictors import PredictorFit
from sere_fx.errors import ArgumentTypeError, ArgumentValueError
from sere_fx.similarity import Similarity

# tokens x experts rows per kernel call (the tokens repeated once per expert)
CHUNK_ROWS = 1 << 16


class KernelExpertOutputs:
    """``Y[e] = expert_e(X)`` for every expert of one vLLM MoE layer, ``[E, T, H]``, through the
    layer's own kernel. ``all_reduce`` sums the ranks' partial outputs (None: one rank)."""

    def __init__(self, runner, num_experts: int, all_reduce=None):
        self.runner = runner
        self.num_experts = num_experts
        self.all_reduce = all_reduce

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        E, T = self.num_experts, x.shape[0]
        experts = self.runner.routed_experts
        experts._ensure_moe_quant_config_init()
        dtype = self.runner._quant_method.topk_indices_dtype or torch.int32
        out = []
        step = max(1, CHUNK_ROWS // E)
        for start in range(0, T, step):
            part = x[start:start + step]
            t = part.shape[0]
            ids = torch.arange(E, device=x.device, dtype=dtype).repeat_interleave(t).unsqueeze(1)  # expert-major
            ones = torch.ones(E * t, 1, dtype=torch.float32, device=x.device)
            y = experts.forward_modular(part.repeat(E, 1), ones, ids)
            if self.all_reduce is not None:
                y = self.all_reduce(y)
            out.append(y.view(E, t, -1))
        return torch.cat(out, dim=1)


class _WorkerCalibration:
    """One worker's hooks and accumulators (``start`` / ``finish``, called through collective_rpc)."""

    def __init__(self, worker, method: str, cka_sample: int, predictors: bool):
        from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

        from sere_fx.vllm.engine import _moe_runners, engine_layers
        from sere_fx.vllm.routing import RouterScores

        config = worker.vllm_config
        if not config.model_config.enforce_eager:
            raise ArgumentValueError("llm", "llm: expected an engine started with enforce_eager=True (a compiled "
                                            "graph does not call the calibration hooks), got one that compiles")
        self.runner = worker.model_runner
        if not hasattr(self.runner, "input_batch"):
            raise ArgumentValueError("llm", f"llm: calibration reads the V1 model runner's batch, got "
                                            f"{type(self.runner).__name__}")
        runners = _moe_runners(self.runner.get_model())
        layers = engine_layers(runners)
        reduce = tensor_model_parallel_all_reduce if get_tensor_model_parallel_world_size() > 1 else None
        self.layers = {layer.index: (layer, runner) for layer, runner in zip(layers, runners)}
        self.accs = {layer.index: accumulator(method, KernelExpertOutputs(runner, layer.num_experts, reduce),
                                              layer.num_experts, cka_sample) for layer, runner in zip(layers, runners)}
        self.fits = {layer.index: PredictorFit(layer.num_experts) for layer in layers} if predictors else {}
        self.scores = {layer.index: RouterScores.of(runner.router) for layer, runner in zip(layers, runners)}
        self.handles = [runner.register_forward_pre_hook(self._hook(layer.index), with_kwargs=True)
                        for layer, runner in zip(layers, runners)]

    def _real_rows(self) -> int:
        batch = self.runner.input_batch
        return int(self.runner.query_start_loc.np[batch.num_reqs])

    def _hook(self, index: int):
        from sere_fx.policies import output_features

        def hook(runner, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            logits = kwargs.get("router_logits", args[1] if len(args) > 1 else None)
            x = hidden.reshape(-1, hidden.shape[-1])
            rows = self._real_rows()
            if rows > x.shape[0]:
                raise RuntimeError(f"calibration: layer {index} got {x.shape[0]} rows for a step of {rows} tokens")
            x = x[:rows]  # padding rows, if any, come last
            with torch.no_grad():
                x_in, _ = runner.apply_routed_input_transform(x)
                also = None
                if self.fits:
                    if runner.gate is not None:
                        logits = runner.gate(x)[0]
                    probs = self.scores[index].probabilities(logits.reshape(-1, logits.shape[-1])[:rows])
                    features = output_features(probs, 0.0, probs)
                    fit = self.fits[index]
                    also = lambda start, y: fit.update(features[start:start + y.shape[1]], y)  # noqa: E731
                self.accs[index].update(x_in, also=also)

        return hook

    def finish(self) -> dict:
        for h in self.handles:
            h.remove()
        out = {}
        for index in sorted(self.accs):  # the same order on every rank: CKA's finalize all-reduces
            acc = self.accs[index]
            out[str(index)] = {"sim": acc.finalize().tolist(), "tokens": acc.tokens,
                               "predictor": self.fits[index].finalize().tolist() if self.fits else None}
        return out


_CALIBRATION: _WorkerCalibration | None = None


def worker_start(worker, method: str, cka_sample: int, predictors: bool) -> list[int]:
    """Worker side: hook this worker's MoE layers (``WorkerBase.sere_calibration_start``)."""
    global _CALIBRATION
    _CALIBRATION = _WorkerCalibration(worker, method, cka_sample, predictors)
    return sorted(_CALIBRATION.accs)


def worker_finish(worker=None) -> dict:
    """Worker side: finalise and unhook (``WorkerBase.sere_calibration_finish``)."""
    global _CALIBRATION
    if _CALIBRATION is None:
        return {}
    try:
        return _CALIBRATION.finish()
    finally:
        _CALIBRATION = None


@torch.no_grad()
def calibrate_engine(llm, windows: torch.Tensor, method: str = "frobenius", *, cka_sample: int = DEFAULT_CKA_SAMPLE,
                     progress: bool = True, extra_metadata: dict | None = None, predictors: bool = True) -> Similarity:
    """Similarity matrices of the model ``llm`` (a ``vllm.LLM`` with ``enforce_eager=True`` and
    ``enable_prefix_caching=False``) serves, on ``windows`` (token ids ``[N, L]``): the same file
    as ``calibrate`` (``sere-fx calibrate --engine vllm``)."""
    from vllm import SamplingParams

    if method not in METHODS:
        raise ArgumentValueError("method", f"method: expected one of {list(METHODS)}, got {method!r}")
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.shape[0] == 0:
        raise ArgumentTypeError("windows", f"windows: expected token ids [N, L] with N >= 1, got "
                                           f"{getattr(windows, 'shape', type(windows).__name__)}")
    # the workers' calibration methods come with the plugin, which vLLM loads in every process
    config = llm.llm_engine.vllm_config
    if config.parallel_config.data_parallel_size > 1:
        raise ArgumentValueError("llm", f"llm: expected data_parallel_size 1 (each data-parallel rank prefills other "
                                        f"windows), got {config.parallel_config.data_parallel_size}")
    if config.cache_config.enable_prefix_caching:
        raise ArgumentValueError("llm", "llm: expected an engine started with enable_prefix_caching=False (cached "
                                        "prompt blocks are not computed, so their tokens would be missing), got it on")
    llm.collective_rpc("sere_calibration_start", args=(method, cka_sample, predictors))
    try:
        prompts = [{"prompt_token_ids": row} for row in windows.tolist()]
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=progress)
    finally:
        per_worker = llm.collective_rpc("sere_calibration_finish")
    layers: dict[int, dict] = {}
    for result in per_worker:  # tensor-parallel ranks agree; pipeline stages hold different layers
        for index, value in result.items():
            layers.setdefault(int(index), value)
    expected = windows.numel()
    short = {i: v["tokens"] for i, v in layers.items() if v["tokens"] != expected}
    if short:
        raise RuntimeError(f"calibration: expected {expected} tokens in every MoE layer, got {short}")
    hf = config.model_config.hf_config
    metadata = {"method": method, "tokens": expected, "engine": "vllm",
                "architecture": (getattr(hf, "architectures", None) or [None])[0],
                "model_type": getattr(hf, "model_type", None),
                "num_hidden_layers": getattr(hf, "num_hidden_layers", None),
                "moe_layers": sorted(layers),
                "num_experts": {str(i): len(v["sim"]) for i, v in sorted(layers.items())},
                "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
                "pipeline_parallel_size": config.parallel_config.pipeline_parallel_size,
                "dtype": str(config.model_config.dtype).removeprefix("torch.")}
    if method == "cka":
        metadata["cka_sample"] = min(cka_sample, expected)
    metadata.update(extra_metadata or {})
    matrices = {i: torch.tensor(v["sim"]) for i, v in layers.items()}
    fitted = {i: torch.tensor(v["predictor"]) for i, v in layers.items() if v["predictor"] is not None}
    return Similarity(matrices, metadata, fitted)
