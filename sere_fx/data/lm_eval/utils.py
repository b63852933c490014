"""sere-fx's lm-evaluation-harness tasks on the test-bed's public text (no download).

Each document is a line in the held-out half of ``eval_public.txt`` (the half that calibration
and tuning on tokens 0:40000 never read): the prompt is the 12 lines before it and the line's
first word with its indentation (a prompt that ended at the newline would split a token the
tokenizer keeps whole: a newline and the next line's indentation), and the target is the rest
of the line. ``sere_next_line`` generates it (until a newline) and scores it by exact match and
by character edit similarity, which moves on a model too small to get many lines exactly right;
``sere_next_line_ll`` scores its log-likelihood per character and whether it is the greedy
continuation (prompt processing only: nothing a decode-time routing policy touches).
"""

from __future__ import annotations

import re

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
        head = re.match(r"\s*\S+", target).end()  # indentation and first word
        if not target[head:].strip():
            continue
        docs.append({"context": "\n".join(lines[i - CONTEXT_LINES:i]) + "\n" + target[:head], "target": target[head:]})
        if len(docs) == max_docs:
            break
    return docs


def load_docs(**kwargs) -> dict:
    """lm-eval's ``custom_dataset``: the documents as a ``test`` split."""
    return {"test": datasets.Dataset.from_list(documents())}


def process_results_ll(doc: dict, results: list) -> dict:
    """The target's negative log-likelihood per character (comparable across documents, unlike
    lm-eval's per-document perplexity) and whether it is the greedy continuation."""
    loglikelihood, is_greedy = results[0]
    return {"nll_per_char": -loglikelihood / len(doc["target"]), "acc": float(is_greedy)}


def process_results(doc: dict, results: list) -> dict:
    prediction = results[0].split("\n", 1)[0].rstrip()
    return {"exact_match": float(prediction == doc["target"]),
            # characters' edit similarity (the same measure sere-fx eval --generate takes over tokens)
            "edit_similarity": float(edit_similarity(list(prediction.strip()), list(doc["target"].strip())))}
