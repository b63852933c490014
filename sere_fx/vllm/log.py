"""The plugin's logger: under ``vllm.`` so that vLLM's log settings apply; plain logging, so that
it works even where vLLM itself cannot be imported."""

from __future__ import annotations

import logging


def logger() -> logging.Logger:
    return logging.getLogger("vllm.sere_fx")
