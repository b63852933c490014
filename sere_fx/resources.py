"""Files shipped with the package: the embedded default model and its text."""

from __future__ import annotations

import os

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def testbed_dir() -> str:
    """The embedded test-bed model (a small Qwen3-MoE trained on Python source)."""
    path = os.path.join(_DATA, "testbed")
    if not os.path.isfile(os.path.join(path, "model", "model.safetensors")):
        raise FileNotFoundError(f"the embedded test-bed model is missing from {path}; reinstall sere-fx")
    return path


def testbed_model() -> str:
    return os.path.join(testbed_dir(), "model")


def testbed_text() -> str:
    return os.path.join(testbed_dir(), "eval_public.txt")


def testbed_chat_template() -> str:
    """A chat template for the test-bed (a base model without one): the messages' text in order,
    so chat requests to a server can be tried (``--chat-template``)."""
    return os.path.join(testbed_dir(), "chat_template.jinja")


def lm_eval_tasks() -> str:
    """The directory of sere-fx's lm-evaluation-harness tasks on the test-bed's text
    (``--include_path``): ``sere_next_line`` (generate until a newline) and ``sere_next_line_ll``
    (the same lines' log-likelihood)."""
    return os.path.join(_DATA, "lm_eval")
