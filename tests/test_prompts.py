"""Text prompts: file formats, tokenisation, errors that name the file and line, the
epoch order, and a PPO run on text prompts with decoded sample tables and exact resume."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

from pjit_ppo import sharding
from pjit_ppo.data import DataError
from pjit_ppo.data import prompts as text
from pjit_ppo.demo import procedural_text as corpus, tokenizer as demo_tokenizer

from tests import runs


@pytest.fixture(scope="module")
def demo_files(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("democorpus"))
    paths = corpus.write(d, corpus.CorpusOptions(num_sentences=400, num_heldout=40))
    with open(paths["corpus_train"]) as f:
        n = demo_tokenizer.train_tokenizer(f, os.path.join(d, "tok"), vocab_size=768)
    return {**paths, "tok": os.path.join(d, "tok"), "n_tokens": n, "dir": d}


def test_formats_load_in_file_order(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"q": "one"}\n\n{"q": "two", "x": 1}\n')
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    assert text.load_prompt_texts(str(tmp_path / "p.jsonl"), field="q") == ["one", "two"]
    assert text.load_prompt_texts(str(tmp_path / "p.txt")) == ["one", "two"]
    with pytest.raises(DataError, match="p.txt:1: not valid JSON"):
        text.load_prompt_texts(str(tmp_path / "p.txt"), fmt="jsonl")


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "ok"}\n{"prompt": \n', "p.jsonl:2: not valid JSON"),
    ('{"prompt": "ok"}\n{"text": "x"}\n', "p.jsonl:2: no field 'prompt'"),
    ('{"prompt": 3}\n', "p.jsonl:1: field 'prompt' is int, not a string"),
    ("\n\n", "no prompts in it"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, content, message):
    (tmp_path / "p.jsonl").write_text(content)
    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        text.load_prompt_texts(str(tmp_path / "p.jsonl"))


def test_missing_file_and_tokenizer_errors(tmp_path, demo_files):
    with pytest.raises(DataError, match="no such file"):
        text.load_prompt_texts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="tokenizer directory not found"):
        text.load_tokenizer(str(tmp_path / "nope"))
    tok = text.load_tokenizer(demo_files["tok"])
    n = len(tok)
    with pytest.raises(DataError, match=f"has {n} tokens but the model's embedding has 64"):
        text.check_tokenizer(tok, path="T", vocab_size=64, pad_id=n, stop_token=None)
    with pytest.raises(DataError, match="ppo.pad_token_id=5 is the text token"):
        text.check_tokenizer(tok, path="T", vocab_size=n, pad_id=5, stop_token=None)
    with pytest.raises(DataError, match=f"no token id {n + 3}"):
        text.check_tokenizer(tok, path="T", vocab_size=n + 8, pad_id=tok.pad_token_id,
                             stop_token=n + 3)
    text.check_tokenizer(tok, path="T", vocab_size=n, pad_id=tok.pad_token_id, stop_token=3)
    text.check_tokenizer(tok, path="T", vocab_size=n + 8, pad_id=n + 2, stop_token=3)


def test_plain_tokenizer_loads_as_autotokenizer_would_without_pytorch(demo_files, tmp_path):
    """A directory with only a `tokenizers` tokenizer, or one beside the config of a model
    of the four families, is read as PreTrainedTokenizerFast directly: the same class,
    vocabulary, special tokens and encodings as AutoTokenizer, and a launch that reads
    text prompts no longer imports PyTorch. A directory with another model type's config
    goes through AutoTokenizer."""
    import subprocess
    import sys

    import transformers
    import tiny_text
    tiny_text.save_tokenizer(str(tmp_path / "tiny"))
    assert text._plain_tokenizers_directory(demo_files["tok"])
    assert text._plain_tokenizers_directory(str(tmp_path / "tiny"))
    paths = [demo_files["tok"], str(tmp_path / "tiny")]
    for model_type, plain in (("gpt2", True), ("gptj", True), ("gpt_neox", True),
                              ("llama", True), ("qwen2", False), ("bert", False)):
        model_dir = tmp_path / model_type
        shutil.copytree(demo_files["tok"], model_dir)
        (model_dir / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert text._plain_tokenizers_directory(str(model_dir)) == plain, model_type
        paths.append(str(model_dir))
    sample = ["the dog likes the old cat.", "a happy cat <eos> loves", ""]
    for path in paths:
        ours, auto = text.load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
        assert type(ours) is type(auto), path
        assert ours.get_vocab() == auto.get_vocab() and len(ours) == len(auto)
        assert ours.special_tokens_map == auto.special_tokens_map
        assert (ours.pad_token_id, ours.eos_token_id) == (auto.pad_token_id, auto.eos_token_id)
        for add in (False, True):
            assert ours(sample, add_special_tokens=add)["input_ids"] == \
                auto(sample, add_special_tokens=add)["input_ids"]
    code = ("import sys; from pjit_ppo.data import prompts; "
            f"t = prompts.load_tokenizer({demo_files['tok']!r}); "
            "print(len(t), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=runs.ROOT, env=runs.env(), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(len(text.load_tokenizer(demo_files["tok"]))), "False"]


def test_tokenize_queries_left_pads_keeps_last_tokens_and_trims(demo_files):
    tok = text.load_tokenizer(demo_files["tok"])
    pad = tok.pad_token_id
    ids = text.tokenize_queries(["the dog", "", "a happy cat loves the old dog"], tok, 4, pad)
    assert ids.dtype == np.int32 and ids.shape == (3, 4)
    dog = tok("the dog", add_special_tokens=False)["input_ids"]
    assert list(ids[0]) == [pad] * (4 - len(dog)) + dog
    assert (ids[1] == pad).all()
    assert list(ids[2]) == tok("a happy cat loves the old dog",
                               add_special_tokens=False)["input_ids"][-4:]
    assert text.trim("xx START a b END c END d", "START", "END") == " a b END c END"
    assert text.trim("no markers", "START", "END") == "no markers"


def test_epoch_order_is_a_fresh_permutation_and_resumable(demo_files):
    mesh = sharding.make_mesh(1, -1, 1)
    texts = [f"p{i}" for i in range(10)]
    tok = text.load_tokenizer(demo_files["tok"])
    stream = text.TextPrompts(mesh, texts, tok, batch_size=8, query_length=4,
                              pad_id=tok.pad_token_id, seed=3)
    seen = np.concatenate([stream.indices(t) for t in range(5)])  # 40 = 4 epochs of 10
    epochs = seen.reshape(4, 10)
    for e in epochs:
        assert sorted(e) == list(range(10))
    assert not all((epochs[0] == e).all() for e in epochs[1:])
    again = text.TextPrompts(mesh, texts, tok, batch_size=8, query_length=4,
                             pad_id=tok.pad_token_id, seed=3)
    assert (again.indices(3) == stream.indices(3)).all()  # a pure function of the iteration
    pos = stream.position(3)
    assert pos["epoch"] == 2 and pos["index_in_epoch"] == 4 and pos["num_prompts"] == 10
    query, mask = stream(3)
    assert query.shape == (8, 4) and query.sharding.is_equivalent_to(
        sharding.batch_sharding(mesh, 2), 2)
    expect = text.tokenize_queries(stream.texts_of(3), tok, 4, tok.pad_token_id)
    np.testing.assert_array_equal(np.asarray(query), expect)
    np.testing.assert_array_equal(np.asarray(mask), expect != tok.pad_token_id)
    assert len(jax.devices()) == 8


def _ppo_args(files, workdir, iterations, extra=()):
    pad = "1"  # the demo tokenizer's <pad>
    return ["train_ppo.py", *runs.train_args(workdir, *runs.ONE_EPOCH, iterations=iterations,
                                             every=2),
        f"--config.data.prompts_path={files['prompts_train']}",
        f"--config.data.tokenizer_path={files['tok']}",
        f"--config.ppo.pad_token_id={pad}",
        "--config.model.random.vocab_size=648",
        "--config.reward.target_ids=(300,301,302)",
        "--config.data.samples_every=2", "--config.data.samples_per_table=4",
        *extra]


def _run(args, ok=True):
    result = runs.run(*args)
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_ppo_on_text_prompts_writes_decoded_samples_and_resumes_exactly(tmp_path, demo_files):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    prompts = str(tmp_path / "prompts.jsonl")
    shutil.copy(demo_files["prompts_train"], prompts)
    demo_files = {**demo_files, "prompts_train": prompts}
    _run(_ppo_args(demo_files, full, 4))
    # A run that crashed after its checkpoint at iteration 2: checkpoint 4 never finished.
    shutil.copytree(full, part)
    shutil.rmtree(os.path.join(part, "checkpoints", "4"))
    _run(_ppo_args(demo_files, part, 4))
    runs.assert_same_metrics(os.path.join(full, "metrics.jsonl"),
                             os.path.join(part, "metrics.jsonl"))
    rows = [json.loads(line) for line in open(os.path.join(full, "samples.jsonl"))]
    assert sorted({r["iteration"] for r in rows}) == [1, 2, 4]
    assert all(isinstance(r["prompt"], str) and isinstance(r["response"], str)
               and np.isfinite(r["score"]) for r in rows)
    words = set(corpus.words())
    assert all(r["prompt"].split()[-1] in words for r in rows)  # real decoded corpus text
    resumed = [json.loads(line) for line in open(os.path.join(part, "samples.jsonl"))]
    assert resumed == rows
    # Resuming after the prompt file changed is refused, and the run's files are kept.
    before = open(os.path.join(part, "metrics.jsonl")).read()
    with open(prompts, "a") as f:
        f.write('{"prompt": "a new prompt"}\n')
    result = _run(_ppo_args(demo_files, part, 6), ok=False)
    assert result.returncode == 2
    assert "cannot resume from checkpoint 4: its prompts were" in result.stderr
    assert open(os.path.join(part, "metrics.jsonl")).read() == before


def test_bad_prompt_file_fails_before_compiling(tmp_path, demo_files):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "the dog"}\n{"text": "x"}\n')
    result = _run(_ppo_args(demo_files, str(tmp_path / "w"), 2, extra=(
        f"--config.data.prompts_path={bad}",)), ok=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: data: {bad}:2: no field 'prompt' (data.prompt_field)")
    assert not os.path.exists(tmp_path / "w" / "metrics.jsonl")


def test_resume_accepts_fields_added_later_at_their_defaults():
    from pjit_ppo.config import RunConfig, json_round_trip, resume_conflicts
    config = RunConfig()
    saved = json_round_trip(config.to_dict())  # as read back from a checkpoint
    del saved["data"]["samples_every"]  # a checkpoint written before the field existed
    assert resume_conflicts(saved, config.to_dict()) == {}
    config.data.samples_every = 3
    assert resume_conflicts(saved, config.to_dict()) == {
        "data.samples_every": ("<absent>", 3)}


def test_saved_hf_dataset_loads_and_its_errors_name_the_directory(tmp_path):
    import datasets  # in the test extra; optional for users (only saved datasets need it)
    rows = {"prompt": ["the dog", "a cat"], "other": [1, 2]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    assert text.load_prompt_texts(str(tmp_path / "ds")) == ["the dog", "a cat"]
    with pytest.raises(DataError, match=r"ds: no column 'text' \(data.prompt_field\)"):
        text.load_prompt_texts(str(tmp_path / "ds"), field="text")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"holds splits \['train'\]"):
        text.load_prompt_texts(str(tmp_path / "dd"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not a dataset saved by datasets.save_to_disk"):
        text.load_prompt_texts(str(tmp_path / "plain"))
