"""sere-fx's lm-evaluation-harness tasks on the test-bed's public text (no download).

Each document is a place in the held-out half of ``eval_public.txt`` (the half that
calibration and tuning on tokens 0:40000 never read): the 12 lines before it are the prompt, and
the line itself is the target. ``sere_next_line`` generates the line (until a newline) and
scores it by exact match and by character edit similarity, which moves on a model too small to
get many lines exactly right; ``sere_next_line_ll`` scores the target's log-likelihood (prompt
processing only: nothing a decode-time routing policy touches).
"""

from __future__ import annotations

import datasets

from sere_fx.generation import edit_similarity
from sere_fx.resources import testbed_text

CONTEXT_LINES = 12
MIN_TARGET_CHARS = 10  # a line with some content: not blank, not a lone bracket
STRIDE = 7  # every 7th such line, so documents do not share most of their prompts


def documents(max_docs: int = 256) -> list[dict]:
    lines = open(testbed_text(), encoding="utf-8").read().split("\n")
    docs = []
    seen = 0
    for i in range(max(len(lines) // 2, CONTEXT_LINES), len(lines)):
        target = lines[i].rstrip()
        if len(target.strip()) < MIN_TARGET_CHARS or "<|endoftext|>" in "".join(lines[i - CONTEXT_LINES:i + 1]):
            continue
        seen += 1
        if seen % STRIDE:
            continue
        docs.append({"context": "\n".join(lines[i - CONTEXT_LINES:i]) + "\n", "target": target})
        if len(docs) == max_docs:
            break
    return docs


def load_docs(**kwargs) -> dict:
    """lm-eval's ``custom_dataset``: the documents as a ``test`` split."""
    return {"test": datasets.Dataset.from_list(documents())}


def process_results(doc: dict, results: list) -> dict:
    prediction = results[0].split("\n", 1)[0].rstrip()
    return {"exact_match": float(prediction == doc["target"]),
            # characters' edit similarity (the same measure sere-fx eval --generate takes over tokens)
            "edit_similarity": float(edit_similarity(list(prediction.strip()), list(doc["target"].strip())))}
