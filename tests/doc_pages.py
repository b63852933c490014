"""The documentation's text, for the tests that run its examples as written."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def page(name: str) -> str:
    """``"README.md"`` or a page of ``docs/`` (``"serving.md"``)."""
    return open(os.path.join(ROOT, name if name == "README.md" else os.path.join("docs", name))).read()


def block(name: str, language: str, must_contain: str) -> str:
    """The one fenced ``language`` block of page ``name`` that contains ``must_contain``."""
    found = [b for b in re.findall(rf"```{language}\n(.*?)```", page(name), re.S) if must_contain in b]
    assert len(found) == 1, f"{name}: expected one {language} block with {must_contain!r}, found {len(found)}"
    return found[0]


def demo_similarity() -> None:
    """``sere-demo/sim.safetensors`` in the current folder, as the examples read it: calibrated on the
    test-bed (eight random windows: quick, with output-size predictors) instead of by ``sere-fx demo``."""
    import torch
    from transformers import AutoModelForCausalLM

    from sere_fx.calibration import calibrate
    from sere_fx.resources import testbed_model

    os.makedirs("sere-demo", exist_ok=True)
    plain = AutoModelForCausalLM.from_pretrained(testbed_model())
    windows = torch.randint(1, plain.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    calibrate(plain, [windows], progress=False).save("sere-demo/sim.safetensors")
