"""An SFT corpus: documents from JSONL or text, tokenised into fixed-length rows with a
loss mask.

Sources:
  text   one document per non-empty line, trained on in full;
  jsonl  one object per line: {text_field: str} (trained on in full) or
         {prompt_field: str, completion_field: str} (only the completion's tokens
         carry loss: the prompt is context).

Rows (`Sequences`) are `seq_length` tokens, right-padded; a target token t (t >= 1,
predicted from tokens < t) is trained on iff `loss_mask[t]`. Without packing each
document is one row, cut after seq_length tokens; with packing the documents are
concatenated (each ended by EOS when asked) and cut into consecutive rows.
"""
from __future__ import annotations

import json
import os
from typing import List, NamedTuple, Optional, Sequence

import numpy as np

from pjit_ppo.data.formats import detect_format
from pjit_ppo.errors import DataError


class Document(NamedTuple):
    """Text before `completion` that is context only (may be ""), the trained text, and
    'file:line' for messages."""
    prompt: str
    completion: str
    where: str


class Sequences(NamedTuple):
    """Host arrays of M rows: ids int32 [M, L], mask bool [M, L] (real tokens),
    loss_mask bool [M, L] (target tokens trained on; never position 0)."""
    ids: np.ndarray
    mask: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def take(self, index) -> "Sequences":
        return Sequences(*(np.asarray(x)[index] for x in self))


def load_documents(path: str, fmt: str = "auto", text_field: str = "text",
                   prompt_field: str = "prompt",
                   completion_field: str = "completion") -> List[Document]:
    """The documents of a corpus file, in file order (DataError naming file and line)."""
    if not path:
        raise DataError("no corpus file given (data_path)")
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file (SFT corpus)")
    if os.path.isdir(path):
        raise DataError(f"{path} is a directory; the SFT corpus is one JSONL or text file")
    fmt = detect_format(path) if fmt == "auto" else fmt
    docs: List[Document] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            if fmt == "text":
                docs.append(Document("", line.rstrip("\n"), where))
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") \
                    from None
            docs.append(_document(record, where, text_field, prompt_field, completion_field))
    if not docs:
        raise DataError(f"{path}: no documents in it (an empty corpus)")
    return docs


def _document(record, where, text_field, prompt_field, completion_field) -> Document:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if text_field in record:
        fields = (text_field,)
    elif prompt_field in record or completion_field in record:
        fields = (prompt_field, completion_field)
    else:
        raise DataError(f"{where}: no field {text_field!r} (text_field) and no "
                        f"{prompt_field!r} + {completion_field!r} (prompt_field, "
                        f"completion_field)")
    for field in fields:
        if field not in record:
            raise DataError(f"{where}: missing field {field!r} (a record with one of "
                            f"{prompt_field!r} / {completion_field!r} needs both)")
        if not isinstance(record[field], str):
            raise DataError(f"{where}: field {field!r} is {type(record[field]).__name__}, "
                            f"not a string")
    if len(fields) == 1:
        return Document("", record[text_field], where)
    return Document(record[prompt_field], record[completion_field], where)


def tokenize_documents(docs: Sequence[Document], tokenizer, eos_id: Optional[int]):
    """[(ids int32 [n], trained bool [n])] per document: prompt tokens untrained, then the
    completion's tokens and EOS (if eos_id is not None) trained. No other special tokens."""
    prompts = tokenizer([d.prompt for d in docs], add_special_tokens=False)["input_ids"]
    completions = tokenizer([d.completion for d in docs], add_special_tokens=False)["input_ids"]
    out = []
    for p, c in zip(prompts, completions):
        c = list(c) + ([eos_id] if eos_id is not None else [])
        out.append((np.asarray(list(p) + c, np.int32),
                    np.asarray([False] * len(p) + [True] * len(c), bool)))
    return out


def make_sequences(examples, seq_length: int, packing: bool) -> Sequences:
    """Rows of `seq_length` tokens from tokenised documents (see the module docstring).

    Without packing, documents with fewer than 2 tokens (nothing to predict) are skipped.
    """
    if packing:
        ids = np.concatenate([e[0] for e in examples]) if examples else np.zeros(0, np.int32)
        trained = np.concatenate([e[1] for e in examples]) if examples else np.zeros(0, bool)
        rows = len(ids) // seq_length
        if rows == 0:
            raise DataError(f"the corpus has {len(ids)} tokens, fewer than one packed row "
                            f"of seq_length={seq_length}; lower seq_length or add data")
        ids = ids[:rows * seq_length].reshape(rows, seq_length)
        trained = trained[:rows * seq_length].reshape(rows, seq_length).copy()
        trained[:, 0] = False
        return Sequences(ids, np.ones_like(ids, bool), trained)
    kept = [(i[:seq_length], t[:seq_length]) for i, t in examples if len(i) >= 2]
    ids = np.zeros((len(kept), seq_length), np.int32)
    mask = np.zeros((len(kept), seq_length), bool)
    loss = np.zeros((len(kept), seq_length), bool)
    for row, (i, t) in enumerate(kept):
        ids[row, :len(i)] = i
        mask[row, :len(i)] = True
        loss[row, 1:len(i)] = t[1:]
    return Sequences(ids, mask, loss)
