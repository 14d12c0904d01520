"""Preference labels: good files load; every kind of bad record is an error naming the file
and line (also through the entry point: one line, exit status 2); tokenisation shapes."""
import json
import os

import numpy as np
import pytest

import runs
import tiny_text
from pjit_ppo.data import DataError
from pjit_ppo.data import preferences


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line in lines))
    return str(path)


def test_best_of_n_and_pairwise_load(tmp_path):
    best = _write(tmp_path / "best.jsonl", [
        {"query": "q1", "responses": ["a", "b", "c", "d"], "choice": 2, "extra": 1}, "",
        {"query": "q2", "responses": ["e", "f", "g", "h"], "choice": 0}])
    records = preferences.load_preferences(best)
    assert [(r.query, r.responses, r.choice) for r in records] == [
        ("q1", ("a", "b", "c", "d"), 2), ("q2", ("e", "f", "g", "h"), 0)]
    assert records[1].where == f"{best}:3"  # the blank line 2 is skipped, numbers are kept
    pair = _write(tmp_path / "pair.jsonl", [{"query": "q", "chosen": "yes", "rejected": "no"}])
    (record,) = preferences.load_preferences(pair)
    assert (record.responses, record.choice) == (("yes", "no"), 0)


GOOD = {"query": "q", "responses": ["a", "b"], "choice": 1}


@pytest.mark.parametrize("bad,message", [
    ('{"query": "q", "responses": ["a", "b"], "choice": 1', "not valid JSON"),
    ({"responses": ["a", "b"], "choice": 0}, "missing field 'query'"),
    ({"query": "q", "responses": ["a", "b"]}, "missing field 'choice'"),
    ({"query": "q", "chosen": "a"}, "missing field 'rejected'"),
    ({"query": "q", "responses": ["a", "b"], "choice": 2}, r"choice=2 is out of range for 2"),
    ({"query": "q", "responses": ["a", "b"], "choice": -1}, "out of range"),
    ({"query": "q", "responses": ["a", "b"], "choice": "1"}, "'choice' is str, not an integer"),
    ({"query": "q", "responses": ["a", "b"], "choice": True}, "'choice' is bool"),
    ({"query": 3, "responses": ["a", "b"], "choice": 0}, "'query' is int, not a string"),
    ({"query": "q", "responses": "ab", "choice": 0}, "'responses' is str, not a list"),
    ({"query": "q", "responses": ["a", 5], "choice": 0}, "must hold strings only, it has int"),
    ({"query": "q", "chosen": "a", "rejected": None}, "'rejected' is null"),
    ({"query": "q", "responses": ["a"], "choice": 0}, "needs >= 2"),
    ({"query": "q", "responses": ["a", "b", "c"], "choice": 0}, "3 responses, but"),
    ([1, 2], "expected a JSON object, got list"),
])
def test_bad_record_names_file_and_line(tmp_path, bad, message):
    path = _write(tmp_path / "labels.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError, match=f"labels.jsonl:3: .*{message}"):
        preferences.load_preferences(path)


def test_empty_missing_and_directory(tmp_path):
    empty = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match="empty.jsonl: no preference labels in it"):
        preferences.load_preferences(empty)
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        preferences.load_preferences(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="is a directory"):
        preferences.load_preferences(str(tmp_path))


def test_tokenize_pads_queries_left_and_responses_right(tmp_path):
    from pjit_ppo.data.prompts import load_tokenizer
    tiny_text.save_tokenizer(str(tmp_path / "tok"))
    tok = load_tokenizer(str(tmp_path / "tok"))
    ids = {w: tok.convert_tokens_to_ids(w) for w in tiny_text.WORDS}
    path = _write(tmp_path / "l.jsonl", [
        {"query": "the cat sees", "responses": ["a ball .", "the tree very good ."], "choice": 1}])
    prefs = preferences.tokenize_preferences(preferences.load_preferences(path), tok,
                                             query_length=2, response_length=4, pad_id=99)
    assert prefs.query.tolist() == [[ids["cat"], ids["sees"]]]  # the last 2 query tokens
    assert prefs.responses.tolist() == [[[ids["a"], ids["ball"], ids["."], 99],
                                         [ids["the"], ids["tree"], ids["very"], ids["good"]]]]
    assert prefs.response_mask.tolist() == [[[True, True, True, False], [True] * 4]]
    assert prefs.choice.tolist() == [1] and prefs.query.dtype == np.int32
    padded = preferences.tokenize_preferences(preferences.load_preferences(path), tok,
                                              query_length=5, response_length=2, pad_id=99)
    assert padded.query.tolist() == [[99, 99, ids["the"], ids["cat"], ids["sees"]]]


RECIPE = """
from pjit_ppo.config import ModelOptions
from pjit_ppo.config import RewardLearningConfig


def get_config(arg=""):
    return RewardLearningConfig(model=ModelOptions(random={random!r}), labels_path={labels!r},
                                tokenizer_path={tok!r}, query_length=6, response_length=6,
                                pad_token_id=1, truncate_token=None, batch_size=8)
"""


def test_bad_label_through_entry_point_is_one_line(tmp_path):
    """A user's bad label file: one line naming file and line, exit status 2, no workdir."""
    labels = _write(tmp_path / "labels.jsonl", [GOOD, GOOD, GOOD, {"query": "q",
                                                                   "responses": ["a", "b"],
                                                                   "choice": 7}])
    recipe = tmp_path / "recipe.py"
    recipe.write_text(RECIPE.format(random=tiny_text.model_random(), labels=labels,
                                    tok=str(tmp_path)))
    workdir = tmp_path / "run"
    proc = runs.run("train_reward.py", f"--config={recipe}", f"--workdir={workdir}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: data: ") and f"{labels}:4: choice=7 is out of range" \
        in lines[0]
    assert not os.path.exists(workdir)
