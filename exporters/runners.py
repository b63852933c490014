"""``load(path)``: run a decode artifact (``export(..., cache="static")``) greedily, in its own runtime.

    runner = sere_fx.exporters.load("model.onnx")
    tokens = runner.generate(input_ids, max_new_tokens=16)   # [B, L + 16], like model.generate

- pt2: ``torch.export.load`` (``import sere_fx`` registers the re-routing op: this module does);
- aoti: ``torch._inductor.aoti_load_package`` (the package itself needs no sere_fx);
- onnx: an onnxruntime session; the cache goes round as past/present tensors.
"""

from __future__ import annotations

import os

import torch

from sere_fx.errors import ArgumentValueError
from sere_fx.exporters.export import package_settings, pt2_settings, read_settings


class Runner:
    """Greedy decoding with an artifact whose batch and cache length were fixed at export."""

    def __init__(self, path: str, settings: dict):
        self.path, self.settings = path, settings
        self.batch = settings["cache"]["batch"]
        self.max_cache_len = settings["cache"]["max_cache_len"]
        self.eos = settings["cache"].get("eos_token_ids") or []
        self.pad = settings["cache"].get("pad_token_id")
        if self.pad is None and self.eos:
            self.pad = self.eos[0]

    def step(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """``logits [B, L, V]`` for ``input_ids [B, L]`` written at ``cache_position [L]``."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the cache (each ``generate`` starts from an empty one)."""

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 16) -> torch.Tensor:
        """Prompt plus ``max_new_tokens`` greedy tokens, ``[B, L + max_new_tokens]``."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else \
                type(input_ids).__name__
            raise ArgumentValueError("input_ids", f"input_ids: expected an int64 [B, L] tensor, got {got}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ArgumentValueError("max_new_tokens", f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
        batch, length = input_ids.shape
        if batch != self.batch:
            raise ArgumentValueError("input_ids", f"input_ids: {self.path} decodes batches of exactly {self.batch} sequences (fixed at "
                             f"export), got {batch}")
        if length >= self.max_cache_len:
            raise ArgumentValueError("input_ids", f"input_ids: a prompt of {length} tokens leaves no room for new ones in the "
                             f"{self.max_cache_len}-position cache of {self.path}")
        if length + max_new_tokens > self.max_cache_len:
            raise ArgumentValueError("max_new_tokens", f"max_new_tokens: a prompt of {length} tokens plus {max_new_tokens} new ones needs "
                             f"{length + max_new_tokens} cache positions; {self.path} has {self.max_cache_len}")
        self.reset()
        tokens = [input_ids]
        finished = torch.zeros(batch, 1, dtype=torch.bool)
        logits = self.step(input_ids, torch.arange(length))
        for position in range(length, length + max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            # As transformers' generate: a sequence that has emitted EOS continues with padding
            # (which still takes part in the batch's routing), and all stop once all have.
            if self.eos:
                nxt = torch.where(finished, self.pad, nxt)
                finished |= torch.isin(nxt, torch.tensor(self.eos))
            tokens.append(nxt)
            if bool(finished.all()) or position + 1 == length + max_new_tokens:
                break
            logits = self.step(nxt, torch.tensor([position]))
        return torch.cat(tokens, dim=1)


class ProgramRunner(Runner):
    """pt2 and aoti: the cache lives in the artifact's buffers (reset by ``cache_position[0]``)."""

    def __init__(self, path: str, settings: dict, call):
        super().__init__(path, settings)
        self.call = call

    def step(self, input_ids, cache_position):
        return torch.as_tensor(self.call(input_ids=input_ids, cache_position=cache_position))


class OnnxRunner(Runner):
    """onnx: past/present tensors (Optimum's names) carried between steps by the runner."""

    def __init__(self, path: str, settings: dict):
        super().__init__(path, settings)
        import onnxruntime as ort

        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.past, self.present = settings["cache"]["past"], settings["cache"]["present"]
        self.shapes = {i.name: i.shape for i in self.session.get_inputs()}
        self.reset()

    def reset(self):
        import numpy as np

        self.cache = {name: np.zeros(self.shapes[name], dtype=np.float32) for name in self.past}

    def step(self, input_ids, cache_position):
        outputs = self.session.run(["logits", *self.present], {"input_ids": input_ids.numpy(),
                                                               "cache_position": cache_position.numpy(), **self.cache})
        self.cache = dict(zip(self.past, outputs[1:]))
        return torch.from_numpy(outputs[0])


def load(path: str | os.PathLike) -> Runner:
    """A greedy runner for a decode artifact written by ``export(..., cache="static")``."""
    path = os.fspath(path)
    package = None
    if path.endswith((".onnx", ".ts")) or not os.path.isfile(path):
        settings = read_settings(path)
    else:
        settings = pt2_settings(path)
        if settings is None:  # an AOTInductor package: loaded once, for its metadata and to run
            package = torch._inductor.aoti_load_package(path)
            settings = package_settings(package)
    if "cache" not in settings:
        raise ArgumentValueError("path", f"path: {path!r} maps input_ids to logits with no KV cache (exported with cache=None); "
                         "export it with cache='static' to decode with it")
    if path.endswith(".onnx"):
        return OnnxRunner(path, settings)
    return ProgramRunner(path, settings, package if package is not None else torch.export.load(path).module())
