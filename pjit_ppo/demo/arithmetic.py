"""Procedural arithmetic word problems for the verifiable-task (GRPO) demo.

Multi-digit addition / subtraction / multiplication problems in a few short English
templates, at a named difficulty (`LEVELS`), deterministic from a seed. `make_splits`
gives disjoint train and held-out sets (no operation on the same operands in both);
`records` turns problems into the JSONL prompt records the trainer reads
(`{"prompt", "answer", "difficulty", "expression"}`), the prompt asking for the final
line `The answer is N.` that `pjit_ppo.rewards.functions.format_check` checks, after one
worked example (EXAMPLE), as turns of the model's chat template when a tokenizer with
one is given. Pure Python.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["Level", "LEVELS", "Problem", "ANSWER_INSTRUCTION", "EXAMPLE", "EXAMPLE_RESPONSE",
           "level", "generate", "make_splits", "prompt_text", "records", "write_jsonl",
           "write_splits"]

#: What every prompt asks for; `pjit_ppo.rewards.functions.ANSWER_FORMAT` matches it.
ANSWER_INSTRUCTION = 'End your reply with "The answer is N." where N is the final number.'

_OPS = ("+", "-", "*")


@dataclasses.dataclass(frozen=True)
class Level:
    """A difficulty: which operations, and how many digits the operands have.

    Attributes:
      name: the `difficulty` field of the records.
      ops: operations drawn uniformly, a subset of "+", "-", "*".
      digits: digits of the two operands of + and - (subtraction puts the larger
        first, so answers are never negative).
      mul_digits: digits of the two factors of *.
    """
    name: str
    ops: Tuple[str, ...]
    digits: Tuple[int, int] = (2, 2)
    mul_digits: Tuple[int, int] = (2, 1)

    def __post_init__(self):
        if not self.ops or set(self.ops) - set(_OPS):
            raise ValueError(f"Level {self.name!r}: ops must be a non-empty subset of "
                             f"'+', '-', '*', got {self.ops!r}")
        if min(self.digits) < 1 or min(self.mul_digits) < 1:
            raise ValueError(f"Level {self.name!r}: digit counts must be >= 1")

    def size(self) -> int:
        """How many distinct operations (op, a, b) the level has (an upper bound on
        the problems `generate` can return)."""
        total = 0
        for op in self.ops:
            na, nb = (9 * 10 ** (d - 1) for d in (self.mul_digits if op == "*"
                                                  else self.digits))
            # equal digit counts: a + b and b + a (a * b and b * a) are one problem, and
            # a - b exists only with a >= b; otherwise every pair is its own problem
            total += na * (na + 1) // 2 if na == nb else na * nb
        return total

    def holds(self, key: Tuple[str, int, int]) -> bool:
        """Whether the operation `key` (a `Problem.key`) is one of this level's."""
        op, a, b = key
        digits = self.mul_digits if op == "*" else self.digits
        return (op in self.ops and min(a, b) > 0
                and sorted((len(str(a)), len(str(b)))) == sorted(digits))


#: The named difficulties (record field `difficulty`).
LEVELS = {lv.name: lv for lv in (
    Level("add1", ("+",), digits=(1, 1)),
    Level("add2x1", ("+",), digits=(2, 1)),
    Level("addsub2x1", ("+", "-"), digits=(2, 1)),
    Level("add2", ("+",), digits=(2, 2)),
    Level("addsub2", ("+", "-"), digits=(2, 2)),
    Level("mul1", ("*",), mul_digits=(1, 1)),
    Level("mul2x1", ("*",), mul_digits=(2, 1)),
    Level("mixed2", ("+", "-", "*"), digits=(2, 2), mul_digits=(2, 1)),
    Level("add3", ("+",), digits=(3, 3)),
    Level("addsub3", ("+", "-"), digits=(3, 3)),
    Level("mul2x2", ("*",), mul_digits=(2, 2)),
)}

_NAMES = ("Tom", "Anna", "Sam", "Maria", "Ben", "Lily", "Omar", "Zoe", "Ravi", "Emma")
_ITEMS = ("apples", "marbles", "stickers", "coins", "pencils", "cookies", "stamps", "cards",
          "books", "shells")
# Templates by operation; {a}, {b} the operands, {name}, {items} drawn per problem.
_TEMPLATES = {
    "+": ("{name} has {a} {items}. {name} gets {b} more {items}. "
          "How many {items} does {name} have now?",
          "There are {a} {items} in a box and {b} {items} in a bag. "
          "How many {items} are there altogether?",
          "A shop sold {a} {items} on Monday and {b} {items} on Tuesday. "
          "How many {items} did it sell in the two days?",
          "What is {a} + {b}?"),
    "-": ("{name} had {a} {items} and gave {b} of them away. "
          "How many {items} does {name} have left?",
          "A shop had {a} {items}. It sold {b} of them. How many {items} are left?",
          "{name} needs {a} {items} and already has {b}. "
          "How many more {items} does {name} need?",
          "What is {a} - {b}?"),
    "*": ("There are {a} boxes with {b} {items} in each box. "
          "How many {items} are there in total?",
          "{name} buys {a} packs of {items}. Each pack has {b} {items}. "
          "How many {items} does {name} buy?",
          "A class has {a} students and each student has {b} {items}. "
          "How many {items} do the students have together?",
          "What is {a} times {b}?"),
}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem: its text, the expression it asks for, the answer, its level."""
    question: str
    expression: str
    answer: int
    difficulty: str

    @property
    def key(self) -> Tuple[str, int, int]:
        """The operation on its operands, order-free for + and * (what the splits share
        none of)."""
        a, op, b = self.expression.split(" ")
        a, b = int(a), int(b)
        return (op, *sorted((a, b))) if op in "+*" else (op, a, b)


#: The worked example every prompt shows first (one-shot; `prompt_text(example=False)`
#: leaves it out). Asked only for the format, SmolLM2-135M-Instruct mostly answers at
#: once with one of the operands (add2: 11% right, greedy); shown this, it writes the
#: calculation, then the answer (31%). No split holds its operation.
EXAMPLE = Problem("Lily has 23 apples. Lily gets 4 more apples. "
                  "How many apples does Lily have now?", "23 + 4", 27, "example")
EXAMPLE_RESPONSE = "23 + 4 = 27. The answer is 27."


def level(name_or_level: Union[str, Level]) -> Level:
    """The Level named `name_or_level` (or the Level itself); ValueError naming the choices."""
    if isinstance(name_or_level, Level):
        return name_or_level
    if name_or_level not in LEVELS:
        raise ValueError(f"unknown difficulty {name_or_level!r}; choose one of "
                         f"{', '.join(LEVELS)}")
    return LEVELS[name_or_level]


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def _draw(rng: random.Random, lv: Level) -> Problem:
    op = rng.choice(lv.ops)
    a, b = (_operand(rng, d) for d in (lv.mul_digits if op == "*" else lv.digits))
    if op == "-":
        a, b = max(a, b), min(a, b)
    answer = a * b if op == "*" else a + b if op == "+" else a - b
    text = rng.choice(_TEMPLATES[op]).format(a=a, b=b, name=rng.choice(_NAMES),
                                             items=rng.choice(_ITEMS))
    return Problem(text, f"{a} {op} {b}", answer, lv.name)


def generate(difficulty: Union[str, Level], n: int, seed: int,
             exclude: Iterable[Tuple[str, int, int]] = ()) -> List[Problem]:
    """`n` distinct problems (no two with the same `key`) of a difficulty, a pure function
    of (difficulty, n, seed, exclude); none whose key is in `exclude`.

    Raises ValueError when the level has fewer than n problems outside `exclude`.
    """
    lv = level(difficulty)
    taken = set(exclude)
    excluded = sum(map(lv.holds, taken))
    if n > lv.size() - excluded:
        raise ValueError(f"difficulty {lv.name!r} has {lv.size()} distinct problems; "
                         f"{n} requested with {excluded} excluded")
    rng = random.Random(f"arithmetic:{lv.name}:{seed}")
    out: List[Problem] = []
    misses = 0
    while len(out) < n:
        problem = _draw(rng, lv)
        if problem.key in taken:
            misses += 1
            if misses > 100 * n + 10_000:  # nearly exhausted level: fail rather than spin
                raise ValueError(f"could not draw {n} distinct problems of {lv.name!r}")
            continue
        taken.add(problem.key)
        out.append(problem)
    return out


def make_splits(difficulty: Union[str, Level], n_train: int, n_eval: int,
                seed: int = 0) -> Tuple[List[Problem], List[Problem]]:
    """(train, held_out): disjoint problem sets (no key in both, neither holds EXAMPLE's),
    each deterministic from the seed; the held-out set does not depend on n_train."""
    held_out = generate(difficulty, n_eval, seed=2 * seed + 1, exclude={EXAMPLE.key})
    train = generate(difficulty, n_train, seed=2 * seed,
                     exclude={EXAMPLE.key} | {p.key for p in held_out})
    return train, held_out


def _turn(problem: Problem) -> str:
    return f"{problem.question}\n{ANSWER_INSTRUCTION}"


def prompt_text(problem: Problem, tokenizer=None, system: Optional[str] = None,
                example: bool = True) -> str:
    """The prompt of a problem: the question and ANSWER_INSTRUCTION, after EXAMPLE and its
    answer when `example`; as chat turns of the tokenizer's chat template (the assistant
    turn opened) when it has one, else as plain text.

    `system`: a system message put first (None: none, so the template's default applies;
    SmolLM2's is 20 tokens). Ignored without a chat template.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        shot = f"{_turn(EXAMPLE)}\n{EXAMPLE_RESPONSE}\n\n" if example else ""
        return shot + _turn(problem)
    messages = [] if system is None else [{"role": "system", "content": system}]
    if example:
        messages += [{"role": "user", "content": _turn(EXAMPLE)},
                     {"role": "assistant", "content": EXAMPLE_RESPONSE}]
    messages.append({"role": "user", "content": _turn(problem)})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def records(problems: Sequence[Problem], tokenizer=None, system: Optional[str] = None,
            example: bool = True) -> List[dict]:
    """Prompt records: {"prompt", "answer" (a string), "difficulty", "expression"}
    (`prompt_text` with the tokenizer, system message and example)."""
    return [{"prompt": prompt_text(p, tokenizer, system, example), "answer": str(p.answer),
             "difficulty": p.difficulty, "expression": p.expression} for p in problems]


def write_jsonl(path: str, rows: Iterable[Mapping]) -> str:
    """Writes one JSON object per line to `path` (parents created); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_splits(out_dir: str, difficulty: Union[str, Level], n_train: int, n_eval: int,
                 seed: int = 0, tokenizer=None, system: Optional[str] = None,
                 example: bool = True) -> Tuple[str, str]:
    """Writes OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl (`make_splits` as `records`);
    returns their paths."""
    train, held_out = make_splits(difficulty, n_train, n_eval, seed)
    return tuple(write_jsonl(os.path.join(out_dir, name),
                             records(problems, tokenizer, system, example))
                 for name, problems in (("train.jsonl", train), ("eval.jsonl", held_out)))
