"""Preference labels from JSONL: best-of-N and pairwise records, parsed strictly.

One JSON object per line (blank lines are skipped), in one of two shapes:

  best-of-N  {"query": str, "responses": [str, ...], "choice": int}   (N >= 2,
             0 <= choice < N: the index of the response the labeller preferred)
  pairwise   {"query": str, "chosen": str, "rejected": str}           (= best-of-2
             with responses [chosen, rejected] and choice 0)

Every record of a file must have the same number of responses (a training batch is
[B, N]). Any record that does not fit raises `DataError` naming the file, the line
and the fix; nothing is dropped silently. Other keys in a record are ignored.
"""
from __future__ import annotations

import json
import os
from typing import List, NamedTuple, Sequence, Tuple

import numpy as np

from pjit_ppo.errors import DataError


class PreferenceRecord(NamedTuple):
    """One label: a query, its N candidate responses, the index chosen; `where` is
    'file:line' (for messages)."""
    query: str
    responses: Tuple[str, ...]
    choice: int
    where: str


class Preferences(NamedTuple):
    """Tokenised labels (host numpy arrays).

    query: int32 [M, Q] left-padded with pad_id (query_mask = query != pad_id).
    responses: int32 [M, N, R] right-padded with pad_id.
    response_mask: bool [M, N, R], True at real response tokens.
    choice: int32 [M], the preferred response of each label.
    """
    query: np.ndarray
    responses: np.ndarray
    response_mask: np.ndarray
    choice: np.ndarray

    def __len__(self) -> int:
        return int(self.choice.shape[0])

    def take(self, index) -> "Preferences":
        """The labels at `index` (an int array or slice), in that order."""
        return Preferences(*(np.asarray(x)[index] for x in self))


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def parse_record(record, where: str) -> PreferenceRecord:
    """One decoded JSON value -> PreferenceRecord; DataError (prefixed by `where`) if bad."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {_type_name(record)}")
    if "query" not in record:
        raise DataError(f"{where}: missing field 'query' (records are {{\"query\", "
                        f"\"responses\", \"choice\"}} or {{\"query\", \"chosen\", \"rejected\"}})")
    if not isinstance(record["query"], str):
        raise DataError(f"{where}: field 'query' is {_type_name(record['query'])}, not a string")
    pairwise = "chosen" in record or "rejected" in record
    if pairwise and "responses" in record:
        raise DataError(f"{where}: has both 'responses' and 'chosen'/'rejected'; use one "
                        f"record shape per line")
    if pairwise:
        for field in ("chosen", "rejected"):
            if field not in record:
                raise DataError(f"{where}: missing field {field!r} (pairwise records need "
                                f"'chosen' and 'rejected')")
            if not isinstance(record[field], str):
                raise DataError(f"{where}: field {field!r} is {_type_name(record[field])}, "
                                f"not a string")
        return PreferenceRecord(record["query"], (record["chosen"], record["rejected"]), 0,
                                where)
    for field in ("responses", "choice"):
        if field not in record:
            raise DataError(f"{where}: missing field {field!r} (best-of-N records need "
                            f"'query', 'responses' and 'choice')")
    responses, choice = record["responses"], record["choice"]
    if not isinstance(responses, list):
        raise DataError(f"{where}: field 'responses' is {_type_name(responses)}, not a list "
                        f"of strings")
    bad = sorted({_type_name(r) for r in responses if not isinstance(r, str)})
    if bad:
        raise DataError(f"{where}: field 'responses' must hold strings only, it has "
                        f"{', '.join(bad)}")
    if len(responses) < 2:
        raise DataError(f"{where}: 'responses' has {len(responses)} entr"
                        f"{'y' if len(responses) == 1 else 'ies'}; a preference needs >= 2")
    if not isinstance(choice, int) or isinstance(choice, bool):
        raise DataError(f"{where}: field 'choice' is {_type_name(choice)}, not an integer")
    if not 0 <= choice < len(responses):
        raise DataError(f"{where}: choice={choice} is out of range for {len(responses)} "
                        f"responses (0..{len(responses) - 1})")
    return PreferenceRecord(record["query"], tuple(responses), choice, where)


def load_preferences(path: str) -> List[PreferenceRecord]:
    """Every label of a JSONL file, in file order.

    Raises DataError naming the file (and line) for a missing file, a directory, a line
    that is not JSON or not a valid record, records with different numbers of
    responses, or a file without records.
    """
    if not path:
        raise DataError("no preference labels file given (labels_path)")
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file (preference labels)")
    if os.path.isdir(path):
        raise DataError(f"{path} is a directory; preference labels are one JSONL file")
    records: List[PreferenceRecord] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") \
                    from None
            record = parse_record(value, where)
            if records and len(record.responses) != len(records[0].responses):
                raise DataError(f"{where}: {len(record.responses)} responses, but "
                                f"{records[0].where} has {len(records[0].responses)}; every "
                                f"label of a file needs the same number (pairwise = 2)")
            records.append(record)
    if not records:
        raise DataError(f"{path}: no preference labels in it (an empty file)")
    return records


def _right_padded(token_lists: Sequence[Sequence[int]], length: int, pad_id: int):
    ids = np.full((len(token_lists), length), pad_id, np.int32)
    mask = np.zeros((len(token_lists), length), bool)
    for row, tokens in enumerate(token_lists):
        tokens = list(tokens)[:length]
        ids[row, :len(tokens)] = tokens
        mask[row, :len(tokens)] = True
    return ids, mask


def tokenize_preferences(records: Sequence[PreferenceRecord], tokenizer, *, query_length: int,
                         response_length: int, pad_id: int, start_text: str = "",
                         end_text: str = "") -> Preferences:
    """Tokenises labels: queries left-padded to their last `query_length` tokens (as PPO's
    prompts, `pjit_ppo.data.prompts.tokenize_queries`), responses right-padded and cut
    to their first `response_length` tokens. No special tokens are added.

    Returns Preferences with M = len(records) and N their (common) response count.
    """
    from pjit_ppo.data.prompts import tokenize_queries
    if not records:
        raise DataError("no preference labels to tokenise")
    n = len(records[0].responses)
    query = tokenize_queries([r.query for r in records], tokenizer, query_length, pad_id,
                             start_text, end_text)
    flat = [resp for r in records for resp in r.responses]
    ids = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    responses, mask = _right_padded(ids, response_length, pad_id)
    m = len(records)
    return Preferences(query, responses.reshape(m, n, response_length),
                       mask.reshape(m, n, response_length),
                       np.asarray([r.choice for r in records], np.int32))


def max_token_id(prefs: Preferences, pad_id: int) -> int:
    """The largest real token id in the labels (-1 if there is none): checked against the
    model's vocabulary before training."""
    q = prefs.query[prefs.query != pad_id]
    r = prefs.responses[prefs.response_mask]
    values = [int(x.max()) for x in (q, r) if x.size]
    return max(values) if values else -1
