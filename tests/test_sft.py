"""Supervised fine-tuning: loss masking of padding and prompts, the LR schedule, a short run
that lowers the held-out loss, its output loading in transformers with matching logits, and
a bad corpus through the entry point."""
import json
import os

import numpy as np
import pytest

import runs
import tiny_text
from pjit_ppo import sft
from pjit_ppo.config import ConfigError, ModelOptions
from pjit_ppo.data import DataError, corpus
from pjit_ppo.config import SFTConfig


class _Tok:
    """A stand-in tokenizer: one id per character."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def test_prompt_and_padding_are_not_trained(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt": "ab", "completion": "cd"}) + "\n"
                    + json.dumps({"text": "xyz"}) + "\n")
    docs = corpus.load_documents(str(path))
    seqs = corpus.make_sequences(corpus.tokenize_documents(docs, _Tok(), eos_id=0), 6,
                                 packing=False)
    a, b, c, d, x, y, z = (ord(ch) for ch in "abcdxyz")
    assert seqs.ids.tolist() == [[a, b, c, d, 0, 0], [x, y, z, 0, 0, 0]]
    assert seqs.mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]
    # Targets trained: the completion and EOS (not the prompt); the whole text after its
    # first token; never padding.
    assert seqs.loss_mask.astype(int).tolist() == [[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0]]
    packed = corpus.make_sequences(corpus.tokenize_documents(docs, _Tok(), eos_id=None), 3,
                                   packing=True)
    assert packed.ids.tolist() == [[a, b, c], [d, x, y]]
    assert packed.loss_mask.astype(int).tolist() == [[0, 0, 1], [0, 1, 1]]


@pytest.mark.parametrize("content,message", [
    ('{"text": "ok"}\n{"text": 5}\n', "c.jsonl:2: field 'text' is int, not a string"),
    ('{"text": "ok"}\n{"prompt": "p"}\n', "c.jsonl:2: missing field 'completion'"),
    ('{"text": "ok"}\n{"foo": "p"}\n', "c.jsonl:2: no field 'text'"),
    ('{"text": "ok"}\n\n{"text": \n', "c.jsonl:3: not valid JSON"),
    ("\n", "c.jsonl: no documents in it"),
])
def test_bad_corpus_names_file_and_line(tmp_path, content, message):
    (tmp_path / "c.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        corpus.load_documents(str(tmp_path / "c.jsonl"))


def test_lr_schedule_warmup_then_decay():
    base = dict(model=ModelOptions(random=tiny_text.model_random()), data_path="c.txt",
                tokenizer_path="t", lr=1e-3, warmup_steps=10, end_lr_fraction=0.1)
    cosine = sft.lr_schedule(SFTConfig(**base), 110)
    assert float(cosine(0)) == 0.0 and float(cosine(5)) == pytest.approx(5e-4)
    assert float(cosine(10)) == pytest.approx(1e-3)
    assert float(cosine(60)) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5), rel=1e-5)
    assert float(cosine(110)) == pytest.approx(1e-4, rel=1e-5)
    linear = sft.lr_schedule(SFTConfig(**base, lr_decay="linear"), 110)
    assert float(linear(60)) == pytest.approx(5.5e-4, rel=1e-5)
    with pytest.raises(ConfigError, match="lr_decay='exp'"):
        SFTConfig(**base, lr_decay="exp").validate()
    with pytest.raises(ConfigError, match="data_path is empty"):
        SFTConfig(**{**base, "data_path": ""}).validate()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft")
    tiny_text.save_tokenizer(str(d / "tok"))
    (d / "corpus.txt").write_text("\n".join(tiny_text.sentences(400)) + "\n")
    config = SFTConfig(model=ModelOptions(random=tiny_text.model_random()),
                       data_path=str(d / "corpus.txt"), tokenizer_path=str(d / "tok"),
                       seq_length=12, batch_size=16, gradient_accumulation_steps=2,
                       max_steps=24, lr=3e-3, warmup_steps=3, eval_every=12, log_every=6,
                       eval_fraction=0.1, tensorboard=False)
    return config, sft.train(config, str(d / "work")), d


@pytest.mark.slow
def test_sft_lowers_held_out_loss(trained):
    config, out, d = trained
    assert out["steps"] == 24
    assert out["test/loss"] < out["test/loss_initial"] - 1.0  # ~4.2 (uniform) -> below 3
    lines = [json.loads(line) for line in open(d / "work" / "metrics.jsonl")]
    tests = [(m["iteration"], m["test/loss"]) for m in lines if "test/loss" in m]
    assert [i for i, _ in tests] == [0, 12, 24]
    assert tests[0][1] > tests[1][1] > tests[2][1]
    train = [m for m in lines if "train/loss" in m]
    assert [m["iteration"] for m in train] == [6, 12, 18, 24]
    assert train[-1]["train/tokens"] > 0 and train[-1]["train/lr"] < train[0]["train/lr"]


@pytest.mark.slow
def test_sft_output_loads_in_transformers_with_matching_logits(trained):
    import torch
    import transformers

    from pjit_ppo.models import lm_logits, load_pretrained
    config, out, d = trained
    model_dir = out["model_dir"]
    assert model_dir == str(d / "work" / sft.MODEL_DIR)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)  # copied beside the model
    ids = np.asarray(tok(["the cat likes the fish very good .", "a dog eats some bread ."],
                         padding="max_length", max_length=9)["input_ids"], np.int32)
    mask = ids != tok.pad_token_id
    cfg, params = load_pretrained(model_dir)
    ours = np.asarray(lm_logits(cfg, params, ids, mask))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids, dtype=torch.long),
                    attention_mask=torch.tensor(mask.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=2e-4, rtol=2e-4)
    # The trained model predicts the grammar: after "the cat" comes a verb.
    verbs = [tok.convert_tokens_to_ids(v) for v in tiny_text.VERBS]
    assert int(np.argmax(ours[0, 1])) in verbs


def test_bad_corpus_through_entry_point_is_one_line(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "the cat"}\n{"txt": "a dog"}\n')
    recipe = tmp_path / "recipe.py"
    recipe.write_text(
        "from pjit_ppo.config import ModelOptions\n"
        "from pjit_ppo.config import SFTConfig\n\n\n"
        "def get_config(arg=''):\n"
        f"    return SFTConfig(model=ModelOptions(random={tiny_text.model_random()!r}),\n"
        f"                     data_path={str(tmp_path / 'c.jsonl')!r}, tokenizer_path="
        f"{str(tmp_path)!r})\n")
    workdir = tmp_path / "run"
    proc = runs.run("train_sft.py", f"--config={recipe}", f"--workdir={workdir}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "c.jsonl:2: no field 'text'" in lines[0], proc.stderr
    assert not os.path.exists(workdir)


def test_epoch_order_is_a_pure_function_of_seed_and_step():
    """What a resume relies on: the rows of step s do not depend on the steps before."""
    from pjit_ppo import loop
    walked = loop.EpochOrder(10, 3, seed=5, tag="sft")
    rows = [walked.rows(step) for step in range(9)]  # 3 steps per epoch, 3 epochs
    for step in reversed(range(9)):
        np.testing.assert_array_equal(loop.EpochOrder(10, 3, 5, "sft").rows(step), rows[step])
    for epoch in range(3):
        visited = np.concatenate(rows[3 * epoch:3 * epoch + 3])
        assert len(set(visited.tolist())) == 9  # 9 of the 10 rows, each once
    assert not np.array_equal(np.concatenate(rows[:3]), np.concatenate(rows[3:6]))
    assert not np.array_equal(loop.EpochOrder(10, 3, 6, "sft").rows(0), rows[0])
    assert not np.array_equal(loop.EpochOrder(10, 3, 5, "reward").rows(0), rows[0])
