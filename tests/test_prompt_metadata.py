"""Prompt records with metadata: JSONL records (and HF dataset columns) keep their other
fields, which travel with their row by index (samples_per_prompt repeats included) to
the reward functions and the sample tables, and are fingerprinted for resume. In-process
and fast; the round trip through a real run, a kill -9 and a resume is in
tests/test_function_reward.py."""
import json

import numpy as np
import pytest

import tiny_text
from pjit_ppo import sharding
from pjit_ppo.config import ConfigError
from pjit_ppo.data import prompts as text
from pjit_ppo.ppo import run as run_lib
from pjit_ppo.rewards import HostFunction, HostScorer
from pjit_ppo.sample_table import SampleTable

RECORDS = [{"prompt": "the cat sees", "answer": "3", "difficulty": 1},
           {"prompt": "a dog likes", "answer": 7},
           {"prompt": "my friend eats", "answer": "0", "difficulty": 2, "tags": ["x", "y"]}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    tiny_text.save_tokenizer(path)
    return text.load_tokenizer(path)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_jsonl_records_keep_their_other_fields(tmp_path):
    texts, metadata = text.load_prompt_records(_write(tmp_path / "p.jsonl", RECORDS))
    assert texts == [r["prompt"] for r in RECORDS]
    assert metadata == [{k: v for k, v in r.items() if k != "prompt"} for r in RECORDS]
    # Another prompt field: "prompt" is then metadata like any other field.
    (tmp_path / "q.jsonl").write_text('{"q": "one", "prompt": "x"}\n')
    assert text.load_prompt_records(str(tmp_path / "q.jsonl"), field="q") == (
        ["one"], [{"prompt": "x"}])
    (tmp_path / "p.txt").write_text("one\ntwo\n")
    assert text.load_prompt_records(str(tmp_path / "p.txt")) == (["one", "two"], [{}, {}])
    assert text.load_prompt_texts(str(tmp_path / "p.jsonl")) == [r["prompt"] for r in RECORDS]


def test_hf_dataset_columns_are_metadata(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"prompt": ["the dog", "a cat"], "answer": ["1", "2"],
                                "level": [3, 4]}).save_to_disk(str(tmp_path / "ds"))
    texts, metadata = text.load_prompt_records(str(tmp_path / "ds"))
    assert texts == ["the dog", "a cat"]
    assert metadata == [{"answer": "1", "level": 3}, {"answer": "2", "level": 4}]


def _stream(tok, texts, metadata, batch_size=4, seed=5):
    mesh = sharding.make_mesh(1, -1, 1)
    return text.TextPrompts(mesh, texts, tok, batch_size=batch_size, query_length=4,
                            pad_id=tok.pad_token_id, seed=seed, metadata=metadata)


def test_records_follow_their_rows_with_repeats(tok):
    texts = [f"the cat sees {i}" for i in range(10)]
    metadata = [{"answer": str(i), **({"odd": True} if i % 2 else {})} for i in range(10)]
    stream = _stream(tok, texts, metadata)
    assert stream.fields == ("answer", "odd")
    for iteration in (0, 3):  # 3 crosses an epoch boundary (positions 12..15 of 10)
        index = stream.indices(iteration)
        rows = np.arange(4 * 3)  # 4 prompts x G=3 samples, rows of a group contiguous
        prompts, meta = stream.records(iteration, rows, samples_per_prompt=3)
        want = [int(index[r // 3]) for r in rows]
        assert prompts == [texts[i] for i in want]
        assert meta["answer"] == [str(i) for i in want]
        assert meta["odd"] == [True if i % 2 else None for i in want]
        # Any subset of rows, in the order given (a process's rows of a micro-batch).
        sub = np.array([7, 2, 11])
        prompts, meta = stream.records(iteration, sub, samples_per_prompt=3)
        assert meta["answer"] == [str(int(index[r // 3])) for r in sub]


def test_fingerprints_and_resume_check(tok):
    texts = [r["prompt"] for r in RECORDS]
    metadata = [{k: v for k, v in r.items() if k != "prompt"} for r in RECORDS]
    plain = _stream(tok, texts, None)
    with_meta = _stream(tok, texts, metadata)
    # The prompt fingerprint is that of the texts alone (earlier checkpoints still resume).
    assert plain.fingerprint == with_meta.fingerprint == text.fingerprint(texts)
    assert "metadata_fingerprint" not in plain.position(2)
    saved = with_meta.position(2)
    assert saved["metadata_fingerprint"] == text.metadata_fingerprint(metadata)
    changed = [dict(m) for m in metadata]
    changed[1]["answer"] = 8
    now = _stream(tok, texts, changed).position(2)
    assert now["metadata_fingerprint"] != saved["metadata_fingerprint"]
    run_lib._check_prompt_stream(saved, with_meta.position(2), 2)
    with pytest.raises(ConfigError, match="metadata.*changed since it was saved"):
        run_lib._check_prompt_stream(saved, now, 2)
    # A checkpoint written before metadata was recorded resumes either way.
    old = {k: v for k, v in saved.items() if k != "metadata_fingerprint"}
    run_lib._check_prompt_stream(old, now, 2)


def test_sample_table_shows_metadata(tmp_path, tok):
    table = SampleTable(str(tmp_path / "samples.jsonl"), pad_id=tok.pad_token_id,
                        tokenizer=tok)
    ids = tok(["the cat sees", "a dog likes"], add_special_tokens=False)["input_ids"]
    samples = {"query": np.array(ids), "query_mask": np.ones((2, 3), bool),
               "response": np.array(ids[::-1]), "score": np.array([0.5, -1.0], np.float32)}
    table.write(4, samples, {"answer": ["3", 7], "difficulty": [1, None]})
    table.write(5, samples)
    lines = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert lines[0] == {"iteration": 4, "prompt": "the cat sees", "response": "a dog likes",
                        "score": 0.5, "metadata": {"answer": "3", "difficulty": 1}}
    assert lines[1]["metadata"] == {"answer": 7, "difficulty": None}
    assert "metadata" not in lines[2]


def test_host_scorer_passes_text_and_metadata_row_by_row(tmp_path, tok):
    """The host decodes the kept tokens (special tokens and ids past the tokenizer's
    vocabulary are not text) and passes each row's own record."""
    log = tmp_path / "calls.jsonl"
    module = tmp_path / "fns.py"
    module.write_text(
        "import json\n"
        f"LOG = {str(log)!r}\n"
        "def score(prompts, responses, **metadata):\n"
        "    with open(LOG, 'a') as f:\n"
        "        f.write(json.dumps([prompts, responses, metadata]) + '\\n')\n"
        "    return [float(len(r.split())) for r in responses]\n"
        "def answer_only(prompts, responses, answer):\n"
        "    return [float(a == '3') for a in answer]\n")
    texts = [r["prompt"] for r in RECORDS]
    metadata = [{k: v for k, v in r.items() if k != "prompt"} for r in RECORDS]
    stream = _stream(tok, texts, metadata, batch_size=2)
    scorer = HostScorer([HostFunction(f"{module}:score"), HostFunction(f"{module}:answer_only")],
                        stream, samples_per_prompt=2)
    words = tok(["the cat sees . very", "a dog"], add_special_tokens=False)["input_ids"]
    eos, vocab = tok.convert_tokens_to_ids("<eos>"), len(tok)
    response = np.array([words[0], words[1] + [eos, vocab + 3, 5]])
    kept = np.array([[True, True, True, True, False], [True, True, True, True, False]])
    rows = np.array([3, 0])  # rows of prompts 1 and 0 (G = 2)
    out = scorer(1, rows, response, kept)
    index = stream.indices(1)
    prompts, responses, meta = json.loads(log.read_text())
    assert prompts == [texts[index[1]], texts[index[0]]]
    assert responses == ["the cat sees .", "a dog"]
    assert meta["answer"] == [metadata[index[1]]["answer"], metadata[index[0]]["answer"]]
    assert meta["tags"] == [metadata[i].get("tags") for i in (index[1], index[0])]
    assert out.dtype == np.float32 and out.shape == (2, 2)
    np.testing.assert_array_equal(out[:, 0], [4.0, 2.0])
    np.testing.assert_array_equal(out[:, 1], [float(m == "3") for m in meta["answer"]])
