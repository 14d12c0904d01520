"""Reward functions written in Python, run on the host between the compiled sampling
program and the compiled scoring program.

The contract: `fn(prompts: list[str], responses: list[str], **metadata) -> sequence of
float`, one score per row. `metadata` holds, for each extra field of the prompt records
(`pjit_ppo.data.prompts`: `{"prompt": ..., "answer": "42"}` gives `answer=[...]`), a
list with one value per row; a function without `**kwargs` gets only the fields its
signature names. Responses are the truncated responses the reward model would see (the
same tokens: `pjit_ppo.rewards.responses.truncate_responses`), decoded with the run's
tokenizer, special tokens (the EOS stop token, padding) left out of the text.

`HostFunction` wraps one SPEC (`pjit_ppo.rewards.spec`) and checks everything a user's
function can get wrong (signature, exceptions with the first failing row, the number
of scores, non-numbers, non-finite values) as one-line `RewardFunctionError`s. To name
the first failing row after a call raised, it calls the function again on one row at
a time (so a function with side effects sees those calls too).
`HostScorer` decodes one process's rows of a rollout micro-batch, finds their prompt
records and calls every function once. numpy only (no jax).
"""
from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from pjit_ppo.rewards import spec as spec_lib
from pjit_ppo.rewards.spec import RewardFunctionError, first_line

#: Prompt records the launch check calls each function on (with empty responses).
DRY_RUN_ROWS = 4


def host_functions(reward_fn) -> Tuple["HostFunction", ...]:
    """The Python functions a RewardFn needs on the host, in the column order of its
    `host_scores` input; () for a reward computed on the devices alone."""
    return tuple(getattr(reward_fn, "host_functions", ()))


def _short(text: Any, limit: int = 60) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[:limit - 4] + "...'"


class HostFunction:
    """One reward function named by a SPEC, loaded on first use.

    Args:
      spec: `package.module:callable` or `path/to/file.py:callable`.
      field: the config field that gives the SPEC (named in every message).
    """

    def __init__(self, spec: str, field: str = "reward.function"):
        self.spec, self.field = spec, field
        self._fn: Optional[Callable] = None
        self._accepts: Dict[Tuple[str, ...], Optional[Tuple[str, ...]]] = {}

    def __repr__(self):
        return f"HostFunction({self.spec!r}, field={self.field!r})"

    @property
    def name(self) -> str:
        return f"{self.field}={self.spec!r}"

    def load(self) -> Callable:
        """The callable (imported on the first call); RewardFunctionError if it cannot be."""
        if self._fn is None:
            self._fn = spec_lib.load(self.spec, self.field)
        return self._fn

    def _fields(self, fields: Tuple[str, ...]) -> Tuple[str, ...]:
        """The metadata fields to pass: all of them with **kwargs, else those the
        signature names. RewardFunctionError when it cannot take (prompts, responses)."""
        if fields in self._accepts:
            return self._accepts[fields]
        fn = self.load()
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature: trust it
            self._accepts[fields] = fields
            return fields
        params = sig.parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            passed = fields
        else:
            named = {p.name for p in params if p.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
            passed = tuple(f for f in fields if f in named)
        try:
            sig.bind([""], [""], **{f: [None] for f in passed})
        except TypeError as e:
            have = ", ".join(fields) or "none"
            raise RewardFunctionError(
                f"{self.name}: {getattr(fn, '__name__', 'the callable')}{sig} cannot be called "
                f"as fn(prompts, responses, **metadata) ({e}; metadata fields: {have}); "
                f"define it as def fn(prompts, responses, **metadata)") from None
        self._accepts[fields] = passed
        return passed

    def __call__(self, prompts: Sequence[str], responses: Sequence[str],
                 metadata: Dict[str, list], *, where: str = "",
                 rows: Optional[Sequence[int]] = None) -> np.ndarray:
        """The function's scores of these rows: float32 [n].

        Args:
          prompts, responses: n strings each.
          metadata: field -> list of n values (one per row).
          where: the batch, for messages ("iteration 3").
          rows: the rows' numbers for messages (episode indices); default 0..n-1.
        Raises RewardFunctionError (see the module docstring).
        """
        n = len(responses)
        rows = list(range(n)) if rows is None else [int(r) for r in rows]
        fields = self._fields(tuple(metadata))
        fn = self.load()
        args = (list(prompts), list(responses))
        kwargs = {f: list(metadata[f]) for f in fields}
        at = f" of {where}" if where else ""
        try:
            result = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- the user's function failed
            raise self._failure(e, args, kwargs, rows, at) from None
        if isinstance(result, np.ndarray):
            if result.ndim != 1:
                raise RewardFunctionError(
                    f"{self.name} returned an array of shape {result.shape} for {n} rows{at}; "
                    f"return one score per response (a list of {n} numbers)")
            result = result.tolist()
        elif isinstance(result, (str, bytes, dict)) or not hasattr(result, "__iter__"):
            raise RewardFunctionError(
                f"{self.name} returned {_short(result)} ({type(result).__name__}) for {n} "
                f"rows{at}, not a sequence of scores; return a list of {n} numbers")
        result = list(result)
        if len(result) != n:
            raise RewardFunctionError(
                f"{self.name} returned {len(result)} scores for {n} rows{at}; return one "
                f"score per response, in the order of the responses")
        out = np.empty(n, np.float32)
        for i, value in enumerate(result):
            if not isinstance(value, numbers.Real):
                raise RewardFunctionError(
                    f"{self.name} returned {_short(value)} ({type(value).__name__}) as the "
                    f"score of row {rows[i]}{at}; scores must be numbers (int or float)")
            out[i] = value
            if not (math.isfinite(float(value)) and np.isfinite(out[i])):
                raise RewardFunctionError(
                    f"{self.name} returned {float(value)!r} as the score of row {rows[i]}{at}; "
                    f"scores must be finite numbers within float32's range")
        return out

    def _failure(self, error: Exception, args, kwargs, rows, at: str) -> RewardFunctionError:
        """The error of a call that raised: the first row that fails alone is named."""
        fn = self.load()
        prompts, responses = args
        for i in range(len(responses)):
            try:
                fn([prompts[i]], [responses[i]], **{f: [v[i]] for f, v in kwargs.items()})
            except Exception as e:  # noqa: BLE001
                return RewardFunctionError(
                    f"{self.name} raised {first_line(e)} at row {rows[i]}{at} (prompt "
                    f"{_short(prompts[i])}, response {_short(responses[i])}); fix the "
                    f"function: it must score any response")
        return RewardFunctionError(
            f"{self.name} raised {first_line(error)} on the {len(responses)} rows{at} (no "
            f"single row fails alone); fix the function: it must score any batch")

    def dry_run(self, prompts: Sequence[str], metadata: Sequence[Dict[str, Any]]) -> None:
        """The launch check: one call on these prompt records with empty responses (a
        response a policy can sample), raising RewardFunctionError before anything heavy."""
        n = len(prompts)
        fields = sorted({k for record in metadata for k in record})
        columns = {f: [record.get(f) for record in metadata] for f in fields}
        self(list(prompts), [""] * n, columns,
             where=f"the launch check (the first {n} prompt records, empty responses)")


class HostScorer:
    """Scores one process's rows of a rollout micro-batch with every host function.

    Args:
      functions: the HostFunctions (`host_functions(reward_fn)`), one column each.
      prompts: the run's prompt stream: `tokenizer` and `records(iteration, rows,
        samples_per_prompt) -> (prompt texts, {field: values})` of batch rows
        (`pjit_ppo.data.prompts.TextPrompts`).
      samples_per_prompt: contiguous rows that share a prompt (ppo.samples_per_prompt).
    """

    def __init__(self, functions: Sequence[HostFunction], prompts, *, samples_per_prompt: int):
        self.functions = tuple(functions)
        self.prompts, self.group = prompts, samples_per_prompt
        self.tokenizer = prompts.tokenizer
        self._vocab = len(self.tokenizer)

    @property
    def columns(self) -> int:
        return len(self.functions)

    def decode(self, response: np.ndarray, kept: np.ndarray) -> List[str]:
        """Texts of int [n, R] rows, only the kept positions; ids the tokenizer does not
        have (embedding rows past its vocabulary) and special tokens are not text."""
        ids = [[int(t) for t, k in zip(row, keep) if k and 0 <= t < self._vocab]
               for row, keep in zip(np.asarray(response), np.asarray(kept))]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def __call__(self, iteration: int, rows: np.ndarray, response: np.ndarray,
                 kept: np.ndarray) -> np.ndarray:
        """Scores float32 [n, H] of batch rows `rows` (int [n], episode indices) of
        iteration `iteration` (0-based), whose sampled tokens are response int [n, R]
        and whose reward-visible positions are kept bool [n, R]."""
        texts, metadata = self.prompts.records(iteration, rows, self.group)
        responses = self.decode(response, kept)
        out = np.empty((len(rows), self.columns), np.float32)
        where = f"iteration {iteration + 1}"
        for j, fn in enumerate(self.functions):
            out[:, j] = fn(texts, responses, metadata, where=where, rows=rows)
        return out
