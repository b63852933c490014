"""Calibration text: local files only, tokenised with the model's own tokenizer.

- ``.txt``: the whole file is one document (``txt_docs="file"``) or each non-empty line
  is one (``txt_docs="line"``);
- ``.jsonl``: one JSON object per line, its ``text`` field;
- ``.parquet``: the ``text`` column.

Only documents with more than ``seq_len`` tokens are used; each is cut into consecutive
windows of ``seq_len`` tokens, and a partial last window is dropped.
"""

from __future__ import annotations

import json
import os

import torch

from sere_fx.errors import ArgumentFileNotFoundError, ArgumentValueError

FORMATS = (".txt", ".jsonl", ".parquet")


def read_documents(path: str | os.PathLike, txt_docs: str = "file") -> list[str]:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ArgumentFileNotFoundError("data", f"data: no file at {path!r}")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".txt":
        text = open(path, encoding="utf-8").read()
        if txt_docs == "file":
            return [text]
        if txt_docs == "line":
            return [line for line in text.splitlines() if line.strip()]
        raise ArgumentValueError("txt_docs", f"txt_docs: expected 'file' or 'line', got {txt_docs!r}")
    if ext == ".jsonl":
        docs = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise ArgumentValueError("data", f"data: {path}:{n}: expected a JSON object with a string 'text' field")
                docs.append(row["text"])
        return docs
    if ext == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if "text" not in table.column_names:
            raise ArgumentValueError("data", f"data: {path!r} has columns {table.column_names}; expected a 'text' column")
        return [t for t in table.column("text").to_pylist() if isinstance(t, str)]
    raise ArgumentValueError("data", f"data: expected a file ending in one of {list(FORMATS)}, got {path!r}")


def token_windows(
    tokenizer, documents, seq_len: int, num_seqs: int | None = None, token_range: tuple[int, int | None] = (0, None)
) -> torch.Tensor:
    """``[N, seq_len]`` int64 windows, at most ``num_seqs`` of them, in document order.

    ``token_range = (start, end)`` keeps only windows lying inside that span of the token
    stream (all documents' tokens, in order): a way to cut one text into disjoint parts,
    e.g. calibration/tuning text and evaluation text.
    """
    if seq_len < 1:
        raise ArgumentValueError("seq_len", f"seq_len: expected a positive int, got {seq_len}")
    if num_seqs is not None and num_seqs < 1:
        raise ArgumentValueError("num_seqs", f"num_seqs: expected a positive int, got {num_seqs}")
    first, last = token_range
    windows = []
    base = 0
    for doc in documents:
        ids = tokenizer(doc, verbose=False)["input_ids"]  # long documents are the point: no length warning
        if len(ids) <= seq_len:
            base += len(ids)
            continue
        for start in range(0, len(ids) - seq_len + 1, seq_len):
            if base + start < first or (last is not None and base + start + seq_len > last):
                continue
            windows.append(ids[start : start + seq_len])
            if num_seqs is not None and len(windows) >= num_seqs:
                return torch.tensor(windows, dtype=torch.int64)
        base += len(ids)
    if not windows:
        if first >= base:
            raise ArgumentValueError("token_range", f"token_range: expected START below the text's {base} tokens, got "
                             f"{first}:{'' if last is None else last}")
        raise ArgumentValueError("data", f"data: no document has more than {seq_len} tokens (in token range {first}:{last})")
    return torch.tensor(windows, dtype=torch.int64)


def batched(windows: torch.Tensor, batch_size: int):
    if batch_size < 1:
        raise ArgumentValueError("batch_size", f"batch_size: expected a positive int, got {batch_size}")
    for start in range(0, windows.shape[0], batch_size):
        yield windows[start : start + batch_size]


def parse_token_range(text: str) -> tuple[int, int | None]:
    """``"A:B"``, ``"A:"`` or ``":B"`` -> ``(A, B)``; for command lines."""
    head, sep, tail = text.partition(":")
    try:
        if not sep:
            raise ValueError
        first = int(head) if head else 0
        last = int(tail) if tail else None
    except ValueError:
        raise ArgumentValueError("token_range", f"token_range: expected 'START:END' (either may be empty), got {text!r}") from None
    if first < 0 or (last is not None and last <= first):
        raise ArgumentValueError("token_range", f"token_range: expected 0 <= START < END, got {text!r}")
    return first, last
