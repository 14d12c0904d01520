"""configs/hf_model.py as a newcomer runs it: their own checkpoint and prompts, and no other
override. The pad and stop ids come from the tokenizer, the run trains and checkpoints,
and config.json records the ids it used."""
import json

import pytest

import own_model_run
import tiny_text


@pytest.mark.slow
@pytest.mark.parametrize("family,overrides", [
    ("llama", dict(tie_word_embeddings=True, max_position_embeddings=128)),  # GQA: 4 q / 2 kv
    ("gpt2", dict(n_positions=128)),
], ids=["llama_gqa_tied", "gpt2"])
def test_own_checkpoint_with_no_other_override(tmp_path_factory, family, overrides):
    # The run (tests/own_model_run.py) is `train_ppo.py --config=configs/hf_model.py
    # --config.model.policy_path=MODEL --config.data.prompts_path=PROMPTS --workdir=DIR`,
    # made once per session: test_newcomer_defects's tests check the gpt2 one too.
    run = own_model_run.own_run(tmp_path_factory, family, **overrides)
    proc, workdir = run["proc"], run["workdir"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [m["iteration"] for m in metrics] == list(range(1, 21))
    config = json.loads((workdir / "config.json").read_text())
    # The tokenizer's own ids: "<pad>" is id 1 and "<eos>" id 2 (tests/tiny_text.py).
    assert config["ppo"]["pad_token_id"] == 1 and config["ppo"]["truncate_token"] == 2
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["10", "20"]
    samples = [json.loads(line) for line in open(workdir / "samples.jsonl")]
    assert samples and all(isinstance(s["prompt"], str) for s in samples)
    assert "random reward head" in proc.stderr  # no reward model given: a smoke test, said so


def test_tokenizer_without_pad_takes_the_first_spare_row(tmp_path):
    from transformers import AutoTokenizer

    from pjit_ppo.config import FROM_TOKENIZER, PPOConfig
    from pjit_ppo.data import special_ids
    tiny_text.save_tokenizer(str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    tokenizer.pad_token = None
    ppo = PPOConfig(pad_token_id=FROM_TOKENIZER, truncate_token=FROM_TOKENIZER)
    resolved = special_ids.resolve_token_ids(ppo, tokenizer, vocab_size=64, prefix="ppo.")
    assert resolved == {"pad_token_id": len(tokenizer), "truncate_token": 2}
    assert ppo.pad_token_id == len(tokenizer) and ppo.truncate_token == 2
    full = PPOConfig(pad_token_id=FROM_TOKENIZER)
    with pytest.raises(Exception, match="no pad token.*ppo.pad_token_id"):
        special_ids.resolve_token_ids(full, tokenizer, vocab_size=len(tokenizer), prefix="ppo.")
