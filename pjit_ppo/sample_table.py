"""Decoded sample tables: WORKDIR/samples.jsonl, one line per episode shown.

Each line: {"iteration": completed iterations, "prompt": str, "response": str,
"score": float}, plus "metadata": {field: value} when the prompt records have other
fields (`pjit_ppo.data.prompts`: e.g. the answer a reward function checks). The
response is shown as the reward saw it (cut after the stop token when
ppo.truncate_token is set). Without a tokenizer (random token prompts) prompt and
response are lists of token ids. Written by process 0 only.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from pjit_ppo.padding import truncate_after_stop


def truncated(response: np.ndarray, stop_token: Optional[int], min_index: int,
              pad_id: int) -> np.ndarray:
    """The reference truncation (padding.truncate_after_stop) of a few host rows:
    tokens after the first stop token at index >= min_index become pad_id
    (int [N, R] -> int [N, R]; unchanged when stop_token is None)."""
    if stop_token is None:
        return np.array(response)
    return np.asarray(truncate_after_stop(jnp.asarray(response), stop_token, min_index,
                                          pad_id)[0])


class SampleTable:
    """Appends decoded samples to `path` (see the module docstring)."""

    def __init__(self, path: str, *, pad_id: int, stop_token: Optional[int] = None,
                 truncate_after: int = 0, tokenizer=None):
        self.path, self.pad_id, self.tokenizer = path, pad_id, tokenizer
        self.stop_token, self.truncate_after = stop_token, truncate_after

    def _text(self, row: np.ndarray, keep: np.ndarray) -> Union[str, List[int]]:
        ids = [int(t) for t, k in zip(row, keep) if k]
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ids

    def rows(self, iteration: int, samples: Dict[str, np.ndarray],
             metadata: Optional[Dict[str, list]] = None) -> List[dict]:
        """Lines for samples = {"query" int [N, Q], "query_mask" bool [N, Q], "response"
        int [N, R], "score" f32 [N]}; metadata: {field: N values} of the rows' prompt
        records (None or {}: no "metadata" key)."""
        response = truncated(samples["response"], self.stop_token, self.truncate_after,
                             self.pad_id)
        if self.stop_token is None:
            kept = np.ones(response.shape, bool)  # every sampled token counts
        else:
            kept = response != self.pad_id
        lines = [{"iteration": iteration, "prompt": self._text(q, qm),
                  "response": self._text(r, k), "score": float(s)}
                 for q, qm, r, k, s in zip(samples["query"], samples["query_mask"], response,
                                           kept, samples["score"])]
        for i, line in enumerate(lines):
            if metadata:
                line["metadata"] = {field: values[i] for field, values in metadata.items()}
        return lines

    def write(self, iteration: int, samples: Dict[str, np.ndarray],
              metadata: Optional[Dict[str, list]] = None) -> None:
        if jax.process_index() != 0:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            for line in self.rows(iteration, samples, metadata):
                f.write(json.dumps(line, ensure_ascii=False, default=str) + "\n")
