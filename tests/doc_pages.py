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
