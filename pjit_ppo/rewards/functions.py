"""Built-in reward functions: exact match of an extracted answer, a regex format check, a
length penalty. Each is an ordinary Python callable of the function-reward contract

    fn(prompts: list[str], responses: list[str], **metadata) -> list[float]

(one float per row; each metadata value is a list with one value per row, the prompt
records' extra fields). A run names one with SPEC `package.module:callable`, e.g.
`--config.reward.function=pjit_ppo.rewards.functions:exact_match`. The ready-made
callables below cover the usual answer forms; for another field or regex, build one
with a factory in a file of your own and name that file:

    # my_rewards.py
    from pjit_ppo.rewards import functions
    reward = functions.exact_match_on(field="label", pattern=functions.BOXED)

    --config.reward.function=my_rewards.py:reward

Pure Python (re, fractions): no jax, cheap to import.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Callable, List, Mapping, Optional, Sequence, Union

__all__ = [
    "NUMBER", "LAST_NUMBER", "BOXED", "HASHES", "ANSWER_IS", "DEFAULT_PATTERNS",
    "ANSWER_FORMAT", "ANSWER_FORMAT_FINAL",
    "extract_answer", "parse_number", "answers_equal",
    "exact_match_on", "format_check_on", "length_penalty_on",
    "exact_match", "exact_match_last_number", "exact_match_answer_is", "exact_match_boxed",
    "exact_match_hashes", "format_check", "format_check_final", "format_check_boxed",
    "format_check_hashes", "length_penalty", "length_penalty_words",
]

RewardFunction = Callable[..., List[float]]
Patterns = Union[str, "re.Pattern", Sequence[Union[str, "re.Pattern"]]]

# ------------------------------------------------------------------ patterns
#: A number as written in prose: optional minus and `$`, digits with optional thousands
#: commas (1,234,567), an optional decimal part; or a bare decimal (.5). The lookbehind
#: keeps a number from starting inside another one (the 5 of "10-5" is 5, not -5).
NUMBER = (r"(?<![\d.])-?\$?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)")
#: The last number anywhere in the response.
LAST_NUMBER = rf"(?P<answer>{NUMBER})"
#: LaTeX `\boxed{...}` (no nested braces inside).
BOXED = r"\\boxed\{(?P<answer>[^{}]*)\}"
#: GSM8K's final line `#### 42`.
HASHES = rf"####\s*(?P<answer>{NUMBER})"
#: "The answer is 42" / "the final answer is: **$1,234**" (any case).
ANSWER_IS = rf"(?i:\bthe\s+(?:final\s+)?answer\s+is)[\s:*]*(?P<answer>{NUMBER})"
#: exact_match's default: the first of these forms the response contains anywhere (its
#: last occurrence) gives the answer; the last number when it has none of them.
DEFAULT_PATTERNS = (BOXED, HASHES, ANSWER_IS, LAST_NUMBER)
#: The answer format the arithmetic demo's prompts ask for ("... The answer is N.").
ANSWER_FORMAT = ANSWER_IS
#: The same, as the last thing in the response (a period, `*` or whitespace may follow).
ANSWER_FORMAT_FINAL = rf"{ANSWER_IS}[\s.*]*\Z"


def _compile(pattern: Patterns, flags: int) -> List["re.Pattern"]:
    items = [pattern] if isinstance(pattern, (str, re.Pattern)) else list(pattern)
    if not items:
        raise ValueError("pattern: give at least one regular expression")
    return [p if isinstance(p, re.Pattern) else re.compile(p, flags) for p in items]


# ------------------------------------------------------------------ answers
def extract_answer(response: str, pattern: Patterns = DEFAULT_PATTERNS,
                   flags: int = 0) -> Optional[str]:
    """The answer text in `response`, or None when no pattern matches.

    `pattern` is a regex or a sequence of them, tried in order; the first one that
    matches anywhere gives its *last* match. From a match the answer is its group
    named `answer`, else its first group, else the whole match.
    """
    for regex in _compile(pattern, flags):
        last = None
        for last in regex.finditer(response):
            pass
        if last is not None:
            if "answer" in regex.groupindex:
                return last.group("answer")
            return last.group(1) if regex.groups else last.group(0)
    return None


_GROUPED = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def parse_number(value) -> Optional[Fraction]:
    """`value` (str, int or float) as an exact number, or None when it is not one.

    Strings may carry `$` / `\\$`, thousands commas (only in groups of three: "1,234"),
    surrounding `*` or whitespace and a trailing period; fractions "3/4" and exponents
    parse. Floats are read through their shortest repr (0.1 -> 1/10). Booleans, NaN and
    infinities are not numbers.
    """
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        value = repr(value)
    text = str(value).replace("\\$", "").replace("$", "").strip().strip("*").strip()
    text = text[:-1] if text.endswith(".") else text
    if _GROUPED.fullmatch(text):
        text = text.replace(",", "")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _normalize_text(value) -> str:
    text = " ".join(str(value).split()).casefold()
    return text[:-1].rstrip() if text.endswith(".") else text


def answers_equal(predicted, target) -> bool:
    """Whether two answers agree: numerically when both parse (`parse_number`), else as
    text (case, surrounding and repeated whitespace, a trailing period ignored).
    None never equals anything."""
    if predicted is None or target is None:
        return False
    a, b = parse_number(predicted), parse_number(target)
    if a is not None and b is not None:
        return a == b
    return _normalize_text(predicted) == _normalize_text(target)


# ------------------------------------------------------------------ contract helpers
def _check_rows(name: str, prompts: Sequence[str], responses: Sequence[str]) -> int:
    if len(prompts) != len(responses):
        raise ValueError(f"{name}: {len(prompts)} prompts but {len(responses)} responses")
    for i, r in enumerate(responses):
        if not isinstance(r, str):
            raise TypeError(f"{name}: response {i} is a {type(r).__name__}, not a str")
    return len(responses)


def _field(name: str, metadata: Mapping[str, Sequence], field: str, rows: int) -> Sequence:
    if field not in metadata:
        have = ", ".join(sorted(metadata)) or "none"
        raise KeyError(f"{name}: the prompt records have no field {field!r} (fields: {have})")
    values = metadata[field]
    if isinstance(values, (str, bytes)) or len(values) != rows:
        raise ValueError(f"{name}: metadata {field!r} must be a list of one value per row "
                         f"({rows} rows)")
    return values


def _named(fn, name: str, doc: str):
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


# ------------------------------------------------------------------ factories
def exact_match_on(field: str = "answer", pattern: Patterns = DEFAULT_PATTERNS, *,
                   flags: int = 0, name: Optional[str] = None) -> RewardFunction:
    """A reward function: 1.0 where the answer extracted from the response
    (`extract_answer(response, pattern, flags)`) equals metadata `field`
    (`answers_equal`: numerically when both parse), else 0.0 (also when nothing is
    extracted or the row's target is None)."""
    regexes = _compile(pattern, flags)
    name = name or f"exact_match_on(field={field!r})"

    def fn(prompts, responses, **metadata) -> List[float]:
        rows = _check_rows(name, prompts, responses)
        targets = _field(name, metadata, field, rows)
        return [float(answers_equal(extract_answer(r, regexes), t))
                for r, t in zip(responses, targets)]

    return _named(fn, name, f"1.0 where the answer extracted by {pattern!r} equals metadata "
                            f"{field!r}, else 0.0.")


def format_check_on(pattern: Patterns = ANSWER_FORMAT, *, flags: int = 0,
                    name: Optional[str] = None) -> RewardFunction:
    """A reward function: 1.0 where any of the regexes `pattern` matches somewhere in the
    response (`re.search`; anchor with `^` / `\\Z` for more), else 0.0."""
    regexes = _compile(pattern, flags)
    name = name or "format_check_on"

    def fn(prompts, responses, **metadata) -> List[float]:
        _check_rows(name, prompts, responses)
        return [float(any(rx.search(r) for rx in regexes)) for r in responses]

    return _named(fn, name, f"1.0 where the response matches {pattern!r}, else 0.0.")


_UNITS = {"chars": len, "words": lambda text: len(text.split())}


def length_penalty_on(target: int = 256, *, unit: str = "chars",
                      per_unit: Optional[float] = None, cap: Optional[float] = 1.0,
                      name: Optional[str] = None) -> RewardFunction:
    """A reward function: -per_unit x (length - target) for responses longer than
    `target`, 0.0 otherwise; never below -cap (None: no floor).

    Args:
      target: the length allowed for free, in `unit`s.
      unit: "chars" (len of the response) or "words" (whitespace-separated pieces).
      per_unit: penalty per unit over target; default 1 / target (-1.0 at twice target).
      cap: the largest penalty, or None.
    """
    if unit not in _UNITS:
        raise ValueError(f"length_penalty_on: unit={unit!r}; choose 'chars' or 'words'")
    if target < 0 or (target == 0 and per_unit is None):
        raise ValueError(f"length_penalty_on: target={target} must be > 0 (or >= 0 with "
                         f"per_unit given)")
    scale = 1.0 / target if per_unit is None else float(per_unit)
    measure = _UNITS[unit]
    name = name or f"length_penalty_on(target={target}, unit={unit!r})"

    def fn(prompts, responses, **metadata) -> List[float]:
        _check_rows(name, prompts, responses)
        out = []
        for r in responses:
            penalty = scale * max(0, measure(r) - target)
            out.append(0.0 - (penalty if cap is None else min(cap, penalty)))
        return out

    return _named(fn, name, f"-{scale:g} per {unit[:-1]} beyond {target} {unit}"
                            f"{'' if cap is None else f', at least -{cap:g}'}.")


# ------------------------------------------------------------------ ready-made (SPECs)
#: pjit_ppo.rewards.functions:exact_match -- \boxed{}, then "#### N", then "The answer is
#: N", then the last number; against metadata "answer".
exact_match = exact_match_on(name="exact_match")
#: pjit_ppo.rewards.functions:exact_match_last_number -- the last number only.
exact_match_last_number = exact_match_on(pattern=LAST_NUMBER, name="exact_match_last_number")
#: pjit_ppo.rewards.functions:exact_match_answer_is -- only "The answer is N" counts.
exact_match_answer_is = exact_match_on(pattern=ANSWER_IS, name="exact_match_answer_is")
#: pjit_ppo.rewards.functions:exact_match_boxed -- only \boxed{...} counts.
exact_match_boxed = exact_match_on(pattern=BOXED, name="exact_match_boxed")
#: pjit_ppo.rewards.functions:exact_match_hashes -- only "#### N" counts.
exact_match_hashes = exact_match_on(pattern=HASHES, name="exact_match_hashes")
#: pjit_ppo.rewards.functions:format_check -- "The answer is N" somewhere (the demo's).
format_check = format_check_on(ANSWER_FORMAT, name="format_check")
#: pjit_ppo.rewards.functions:format_check_final -- "The answer is N" ends the response.
format_check_final = format_check_on(ANSWER_FORMAT_FINAL, name="format_check_final")
#: pjit_ppo.rewards.functions:format_check_boxed -- a \boxed{...} somewhere.
format_check_boxed = format_check_on(BOXED, name="format_check_boxed")
#: pjit_ppo.rewards.functions:format_check_hashes -- a "#### N" somewhere.
format_check_hashes = format_check_on(HASHES, name="format_check_hashes")
#: pjit_ppo.rewards.functions:length_penalty -- 0 up to 256 characters, -1 from 512 on.
length_penalty = length_penalty_on(256, unit="chars", name="length_penalty")
#: pjit_ppo.rewards.functions:length_penalty_words -- 0 up to 64 words, -1 from 128 on.
length_penalty_words = length_penalty_on(64, unit="words", name="length_penalty_words")
