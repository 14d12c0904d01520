"""The built-in reward functions (pjit_ppo.rewards.functions): answer extraction, numeric
comparison, exact match, format check, length penalty, and the function contract."""
import importlib
import importlib.util
import re
import subprocess
import sys
from fractions import Fraction

import pytest

from pjit_ppo.rewards import functions as F


def _rows(n):
    return [f"prompt {i}" for i in range(n)]


# ------------------------------------------------------------------ extraction
@pytest.mark.parametrize("response, expected", [
    ("The answer is 42.", "42"),
    ("so 10-5=5", "5"),                      # the 5 of "-5" after a digit is not negative
    ("It is -7 degrees", "-7"),
    ("first 3, then 4, finally 12", "12"),   # several numbers: the last
    ("The total is 1,234,567 apples.", "1,234,567"),
    ("1,2345", "2345"),                      # not a thousands group: two numbers
    ("the numbers 3,4", "4"),
    ("It costs $3.50.", "$3.50"),
    ("about .5 of it", ".5"),
    ("version 1.2.3", "1.2"),
    ("no number here", None),
    ("", None),
    ("x = 4 and \\boxed{17} then 99", "17"),  # boxed wins over the last number
    ("\\boxed{1} ... \\boxed{3/4}", "3/4"),    # the last box
    ("steps 3 4\n#### 1,000\nok 5", "1,000"),  # #### wins over the last number
    ("The answer is **$1,234**. Later 7", "$1,234"),  # answer-is wins over the last number
    ("THE FINAL ANSWER IS: 9", "9"),
    ("The answer is 13 + 88 = 101", "13"),
    ("The answer is 4. No wait, the answer is 5. Or 6", "5"),
])
def test_extract_answer_default(response, expected):
    assert F.extract_answer(response) == expected


def test_extract_answer_custom_patterns():
    assert F.extract_answer("a 1 b 2", r"a (\d)") == "1"           # first group
    assert F.extract_answer("a 1 b 2", r"[ab] \d") == "b 2"         # whole match, last one
    assert F.extract_answer("Answer: 12", r"Answer: (?P<answer>\d+)") == "12"
    assert F.extract_answer("ANSWER: 12", r"answer: (\d+)", flags=re.I) == "12"
    # the sequence is tried in order; the first that matches anything decides
    assert F.extract_answer("x 3 #### 8", [F.BOXED, F.LAST_NUMBER, F.HASHES]) == "8"
    assert F.extract_answer("x 3", [F.BOXED, F.HASHES]) is None
    assert F.extract_answer("The answer is 5, then 6", F.LAST_NUMBER) == "6"


# ------------------------------------------------------------------ numbers
@pytest.mark.parametrize("value, expected", [
    ("42", Fraction(42)), (42, Fraction(42)), ("42.0", Fraction(42)), (42.0, Fraction(42)),
    ("-3.5", Fraction(-7, 2)), ("$1,234", Fraction(1234)), ("\\$1,234.50", Fraction(246900, 200)),
    ("42.", Fraction(42)), (" **17** ", Fraction(17)), ("3/4", Fraction(3, 4)),
    (0.1, Fraction(1, 10)), (".5", Fraction(1, 2)), ("1e3", Fraction(1000)),
    ("1,23", None), ("abc", None), ("", None), (None, None), (True, None), ("nan", None),
    ("inf", None), ("1/0", None),
])
def test_parse_number(value, expected):
    assert F.parse_number(value) == expected


@pytest.mark.parametrize("predicted, target, equal", [
    ("42", "42", True), ("42", 42, True), ("42.0", "42", True), ("$1,000", 1000, True),
    ("-12", "-12", True), ("-12", "12", False), ("0.5", "1/2", True), ("3.50", 3.5, True),
    ("42", "43", False), (None, "42", False), ("42", None, False),
    ("Paris", " paris. ", True), ("New  York", "new york", True), ("Paris", "London", False),
    ("42", "forty-two", False),
])
def test_answers_equal(predicted, target, equal):
    assert F.answers_equal(predicted, target) is equal


# ------------------------------------------------------------------ exact match
def test_exact_match_edge_cases():
    responses = [
        "27 + 41 = 68. The answer is 68.",        # right, str target
        "The answer is 68",                        # right, int target
        "The answer is -5.",                       # negative
        "It costs $1,250.00 in total.",            # commas, $ and decimals
        "I am not sure.",                          # no number
        "The answer is 30 + 49 = 79",              # the stated answer is 30
        "\\boxed{12} though 13 is close",          # boxed decides
        "Step 1: 3. Step 2: 9",                    # last number
        "2.5",
        "The answer is 7.",                        # wrong
    ]
    answers = ["68", 68, "-5", "1250", "1", "79", 12, "9", 2.5, "8"]
    scores = F.exact_match(_rows(10), responses, answer=answers, difficulty=["x"] * 10)
    assert scores == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert all(type(s) is float for s in scores)


def test_exact_match_ready_made_variants():
    responses = ["The answer is 5. Then 6.", "\\boxed{6}", "#### 6", "6", "The answer is 6"]
    answers = ["6"] * 5
    rows = _rows(5)
    # the default trusts "The answer is 5" over a later number
    assert F.exact_match(rows, responses, answer=answers) == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert F.exact_match_last_number(rows, responses, answer=answers) == [1.0] * 5
    assert F.exact_match_answer_is(rows, responses, answer=answers) == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert F.exact_match_boxed(rows, responses, answer=answers) == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert F.exact_match_hashes(rows, responses, answer=answers) == [0.0, 0.0, 1.0, 0.0, 0.0]


def test_exact_match_on_field_and_pattern():
    reward = F.exact_match_on(field="label", pattern=r"Result: (\S+)")
    scores = reward(_rows(4), ["Result: blue", "Result: 7", "Result: 7.0", "blue"],
                    label=["Blue", 7, "7", "blue"], answer=["x"] * 4)
    assert scores == [1.0, 1.0, 1.0, 0.0]
    assert reward.__name__ == "exact_match_on(field='label')"
    # a None target never matches
    assert F.exact_match(_rows(2), ["1", "None"], answer=[None, None]) == [0.0, 0.0]


def test_exact_match_errors_name_the_function():
    with pytest.raises(KeyError, match=r"exact_match: .*no field 'answer' \(fields: "
                                       r"difficulty\)"):
        F.exact_match(_rows(1), ["1"], difficulty=[3])
    with pytest.raises(ValueError, match="exact_match: metadata 'answer' must be a list of "
                                         "one value per row"):
        F.exact_match(_rows(2), ["1", "2"], answer=["1"])
    with pytest.raises(ValueError, match="exact_match: metadata 'answer'"):
        F.exact_match(_rows(2), ["1", "2"], answer="12")
    with pytest.raises(ValueError, match="exact_match: 1 prompts but 2 responses"):
        F.exact_match(_rows(1), ["1", "2"], answer=["1", "2"])
    with pytest.raises(TypeError, match="exact_match: response 1 is a int"):
        F.exact_match(_rows(2), ["1", 2], answer=["1", "2"])
    with pytest.raises(ValueError, match="at least one regular expression"):
        F.exact_match_on(pattern=[])


# ------------------------------------------------------------------ format
def test_format_check_default_is_the_demo_format():
    from pjit_ppo.demo import arithmetic
    assert "The answer is N." in arithmetic.ANSWER_INSTRUCTION
    responses = ["27 + 41 = 68. The answer is 68.", "the answer is -3", "The answer is **12**",
                 "68", "The answer is sixty", "The answer is 5.\nThis is a classic fallacy",
                 ""]
    assert F.format_check(_rows(7), responses) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert F.format_check_final(_rows(7), responses) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert F.format_check_final(_rows(2), ["The answer is 4. \n", "The answer is 4. 5"]) == \
        [1.0, 0.0]


def test_format_check_variants_and_factory():
    responses = ["\\boxed{3}", "#### 3", "Answer: 3", "3"]
    rows = _rows(4)
    assert F.format_check_boxed(rows, responses) == [1.0, 0.0, 0.0, 0.0]
    assert F.format_check_hashes(rows, responses) == [0.0, 1.0, 0.0, 0.0]
    anchored = F.format_check_on(r"^Answer: \d+$", flags=re.M)
    assert anchored(rows, responses, extra=[1, 2, 3, 4]) == [0.0, 0.0, 1.0, 0.0]
    either = F.format_check_on([F.BOXED, F.HASHES])
    assert either(rows, responses) == [1.0, 1.0, 0.0, 0.0]


# ------------------------------------------------------------------ length
def test_length_penalty_chars_default():
    responses = ["", "a" * 256, "a" * 257, "a" * 384, "a" * 512, "a" * 5000]
    scores = F.length_penalty(_rows(6), responses, answer=["1"] * 6)
    assert scores == pytest.approx([0.0, 0.0, -1 / 256, -0.5, -1.0, -1.0])
    assert str(scores[0]) == "0.0"  # not -0.0


def test_length_penalty_words_and_factory():
    words = lambda n: " ".join(["w"] * n)  # noqa: E731
    assert F.length_penalty_words(_rows(3), [words(64), words(96), words(500)]) == \
        pytest.approx([0.0, -0.5, -1.0])
    uncapped = F.length_penalty_on(10, unit="words", per_unit=0.1, cap=None)
    assert uncapped(_rows(3), [words(5), words(15), words(110)]) == pytest.approx(
        [0.0, -0.5, -10.0])
    capped = F.length_penalty_on(4, per_unit=0.25, cap=0.5)
    assert capped(_rows(3), ["abcd", "abcdef", "abcdefghijkl"]) == pytest.approx(
        [0.0, -0.5, -0.5])
    zero_target = F.length_penalty_on(0, per_unit=1.0)
    assert zero_target(_rows(2), ["", "ab"]) == pytest.approx([0.0, -1.0])
    with pytest.raises(ValueError, match="unit='tokens'"):
        F.length_penalty_on(10, unit="tokens")
    with pytest.raises(ValueError, match="target=0 must be > 0"):
        F.length_penalty_on(0)


# ------------------------------------------------------------------ SPECs
@pytest.mark.parametrize("name", ["exact_match", "exact_match_last_number",
                                  "exact_match_answer_is", "exact_match_boxed",
                                  "exact_match_hashes", "format_check", "format_check_final",
                                  "format_check_boxed", "format_check_hashes",
                                  "length_penalty", "length_penalty_words"])
def test_ready_made_callables_are_named_by_their_spec(name):
    module, attr = f"pjit_ppo.rewards.functions:{name}".split(":")
    fn = getattr(importlib.import_module(module), attr)
    assert callable(fn) and fn.__name__ == name and fn.__doc__
    scores = fn(["p"], ["The answer is 1."], answer=["1"])
    assert len(scores) == 1 and isinstance(scores[0], float)


def test_file_spec_with_a_factory(tmp_path):
    """A user's file builds a configured function; the file's callable is what SPEC names."""
    path = tmp_path / "my_rewards.py"
    path.write_text("from pjit_ppo.rewards import functions\n"
                    "reward = functions.exact_match_on(field='label', "
                    "pattern=functions.BOXED)\n")
    spec = importlib.util.spec_from_file_location("my_rewards", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.reward(_rows(2), ["\\boxed{4}", "4"], label=[4, 4]) == [1.0, 0.0]


def test_importing_the_functions_does_not_import_jax():
    code = ("import sys, pjit_ppo.rewards.functions as f; "
            "f.exact_match(['p'], ['1'], answer=['1']); "
            "print('jax' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split()[0] == "False"
