"""The arithmetic problems of the verifiable-task demo (pjit_ppo.demo.arithmetic):
determinism, disjoint splits, correct answers, the answer-format instruction, records."""
import json

import pytest

from pjit_ppo.demo import arithmetic as A
from pjit_ppo.rewards import functions as F

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


def _tokenizer(chat_template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<|im_end|>": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                   eos_token="<|im_end|>")
    fast.chat_template = chat_template
    return fast


def test_same_seed_same_problems_other_seed_other_problems():
    first = A.make_splits("mixed2", 300, 100, seed=3)
    assert first == A.make_splits("mixed2", 300, 100, seed=3)
    other = A.make_splits("mixed2", 300, 100, seed=4)
    assert len({p.key for p in first[1]} & {p.key for p in other[1]}) < 10
    # the held-out set does not depend on how many training problems are drawn
    assert A.make_splits("mixed2", 10, 100, seed=3)[1] == first[1]
    assert A.generate("add2", 50, seed=7) == A.generate("add2", 50, seed=7)


@pytest.mark.parametrize("name", sorted(A.LEVELS))
def test_splits_are_disjoint_and_answers_correct(name):
    lv = A.LEVELS[name]
    n_train, n_eval = (400, 128) if lv.size() > 2000 else (30, 15)  # add1 has 45 in all
    train, held_out = A.make_splits(name, n_train, n_eval, seed=0)
    train_keys, held_keys = {p.key for p in train}, {p.key for p in held_out}
    # no repeats within a split
    assert (len(train), len(held_out)) == (len(train_keys), len(held_keys)) == (n_train, n_eval)
    assert not train_keys & held_keys
    assert not {p.question for p in train} & {p.question for p in held_out}
    for p in train + held_out:
        a, op, b = p.expression.split(" ")
        assert p.answer == eval(p.expression) and p.answer >= 0  # noqa: S307
        assert p.difficulty == name and op in lv.ops
        digits = lv.mul_digits if op == "*" else lv.digits
        if op == "-":
            assert int(a) >= int(b) and (len(a), len(b)) == tuple(sorted(digits, reverse=True))
        else:
            assert (len(a), len(b)) == digits
        assert a in p.question and b in p.question


def test_every_operation_and_template_is_drawn():
    problems = A.generate("mixed2", 600, seed=1)
    assert {p.expression.split(" ")[1] for p in problems} == {"+", "-", "*"}
    starts = {p.question.split(" ")[0] for p in problems}
    assert {"There", "A", "What"} <= starts


def test_level_sizes_are_exact_and_bound_generation():
    assert A.LEVELS["add1"].size() == 45  # unordered pairs of 1..9
    assert A.LEVELS["mul2x1"].size() == 90 * 9
    assert A.LEVELS["mul2x2"].size() == 90 * 91 // 2
    assert A.LEVELS["addsub2"].size() == 2 * 90 * 91 // 2
    assert A.LEVELS["addsub2x1"].size() == 2 * 90 * 9
    assert A.LEVELS["mul1"].size() == 45
    every = A.generate("add1", 45, seed=0)
    assert sorted(p.key for p in every) == sorted(
        ("+", a, b) for a in range(1, 10) for b in range(a, 10))
    with pytest.raises(ValueError, match="'add1' has 45 distinct problems; 46 requested"):
        A.generate("add1", 46, seed=0)
    with pytest.raises(ValueError, match="40 requested with 10 excluded"):
        A.generate("add1", 40, seed=0, exclude={p.key for p in every[:10]} | {("+", 10, 20)})
    assert all(A.LEVELS["add1"].holds(p.key) for p in every)
    assert not any(A.LEVELS["add1"].holds(k) for k in [("+", 10, 2), ("-", 3, 2), ("*", 3, 2)])
    assert A.LEVELS["mixed2"].holds(("*", 7, 12)) and A.LEVELS["mixed2"].holds(("-", 12, 10))
    with pytest.raises(ValueError, match="unknown difficulty 'add9'; choose one of add1"):
        A.generate("add9", 1, seed=0)
    with pytest.raises(ValueError, match="ops must be a non-empty subset"):
        A.Level("bad", ("/",))
    with pytest.raises(ValueError, match="digit counts must be >= 1"):
        A.Level("bad", ("+",), digits=(0, 2))
    custom = A.Level("sub4", ("-",), digits=(4, 4))
    assert all(len(p.expression.split(" ")[0]) == 4 for p in A.generate(custom, 20, seed=0))


def test_prompts_ask_for_the_format_the_rewards_check():
    problem = A.generate("add2", 1, seed=0)[0]
    text = A.prompt_text(problem, example=False)
    assert text == f"{problem.question}\n{A.ANSWER_INSTRUCTION}"
    assert A.prompt_text(problem) == (f"{A.EXAMPLE.question}\n{A.ANSWER_INSTRUCTION}\n"
                                      f"{A.EXAMPLE_RESPONSE}\n\n{text}")
    # the worked example answers in the format, correctly
    assert F.format_check_final([""], [A.EXAMPLE_RESPONSE]) == [1.0]
    assert F.exact_match_answer_is([""], [A.EXAMPLE_RESPONSE], answer=[A.EXAMPLE.answer]) == \
        [1.0]
    assert eval(A.EXAMPLE.expression) == A.EXAMPLE.answer  # noqa: S307
    # the instruction's own form, filled in, is what format_check and exact_match accept
    filled = f"{problem.expression} = {problem.answer}. " + \
        'The answer is N.'.replace("N", str(problem.answer))
    assert 'The answer is N.' in A.ANSWER_INSTRUCTION
    assert F.format_check([text], [filled]) == [1.0]
    assert F.format_check_final([text], [filled]) == [1.0]
    assert F.exact_match_answer_is([text], [filled], answer=[str(problem.answer)]) == [1.0]


def test_prompts_use_the_chat_template_when_there_is_one():
    problem = A.generate("mul2x1", 1, seed=0)[0]
    chat = A.prompt_text(problem, _tokenizer(CHATML), example=False)
    assert chat == (f"<|im_start|>user\n{problem.question}\n{A.ANSWER_INSTRUCTION}<|im_end|>\n"
                    f"<|im_start|>assistant\n")
    assert A.prompt_text(problem, _tokenizer(CHATML)) == (
        f"<|im_start|>user\n{A.EXAMPLE.question}\n{A.ANSWER_INSTRUCTION}<|im_end|>\n"
        f"<|im_start|>assistant\n{A.EXAMPLE_RESPONSE}<|im_end|>\n" + chat)
    assert A.prompt_text(problem, _tokenizer(None)) == A.prompt_text(problem)
    assert A.prompt_text(problem, _tokenizer(CHATML), system="Be brief.", example=False) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n" + chat
    assert A.prompt_text(problem, _tokenizer(None), system="Be brief.") == A.prompt_text(problem)


def test_no_split_holds_the_example():
    train, held_out = A.make_splits("add2x1", 700, 100, seed=0)
    keys = {p.key for p in train + held_out}
    assert len(keys) == 800 and A.EXAMPLE.key not in keys
    assert A.EXAMPLE.key in {p.key for p in A.generate("add2x1", 810, seed=0)}


def test_records_and_jsonl_files(tmp_path):
    tok = _tokenizer(CHATML)
    train_path, eval_path = A.write_splits(str(tmp_path / "data"), "addsub2", 20, 8, seed=5,
                                           tokenizer=tok)
    assert (train_path, eval_path) == (str(tmp_path / "data" / "train.jsonl"),
                                       str(tmp_path / "data" / "eval.jsonl"))
    rows = {p: [json.loads(line) for line in open(p, encoding="utf-8")]
            for p in (train_path, eval_path)}
    assert [len(rows[train_path]), len(rows[eval_path])] == [20, 8]
    train, held_out = A.make_splits("addsub2", 20, 8, seed=5)
    assert rows[train_path] == A.records(train, tok)
    A.write_splits(str(tmp_path / "sys"), "addsub2", 20, 8, seed=5, tokenizer=tok, system="S")
    with open(tmp_path / "sys" / "eval.jsonl", encoding="utf-8") as f:
        assert [json.loads(line) for line in f] == A.records(held_out, tok, system="S")
    for record, problem in zip(rows[eval_path], held_out):
        assert set(record) == {"prompt", "answer", "difficulty", "expression"}
        assert record["answer"] == str(problem.answer) and isinstance(record["answer"], str)
        assert record["difficulty"] == "addsub2"
        assert record["prompt"].endswith(f"<|im_start|>user\n{problem.question}\n"
                                         f"{A.ANSWER_INSTRUCTION}<|im_end|>\n"
                                         f"<|im_start|>assistant\n")
        assert record["prompt"].startswith(f"<|im_start|>user\n{A.EXAMPLE.question}")
        assert A.ANSWER_INSTRUCTION in record["prompt"]
    assert not ({r["expression"] for r in rows[train_path]}
                & {r["expression"] for r in rows[eval_path]})
