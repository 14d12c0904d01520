"""Bad values for the stages before PPO, launched as a user launches them: the SFT and
reward-learning entry points in real subprocesses, each on a work directory that holds
an earlier run. Every case ends with exit status 2 and one `error:` line naming the
field, the value and the allowed range, and the earlier run's files are byte-identical
afterwards (a fresh work directory is not created).
"""
import concurrent.futures
import json
import subprocess

import pytest

import runs
import tiny_text

SFT_RECIPE = """
from pjit_ppo.config import ModelOptions, SFTConfig


def get_config(arg=""):
    return SFTConfig(model=ModelOptions(random={random!r}), data_path={corpus!r},
                     tokenizer_path={tok!r}, seq_length=12, batch_size=8)
"""

REWARD_RECIPE = """
from pjit_ppo.config import ModelOptions, RewardLearningConfig


def get_config(arg=""):
    return RewardLearningConfig(model=ModelOptions(random={random!r}), labels_path={labels!r},
                                tokenizer_path={tok!r}, query_length=6, response_length=6,
                                pad_token_id=1, truncate_token=None, batch_size=8)
"""

#: (id, entry point, overrides, fragments of the one error line)
CASES = (
    ("sft_negative_lr", "train_sft.py", ("--config.lr=-0.1",), ("lr=-0.1", "[0, 1]")),
    ("sft_b2_one", "train_sft.py", ("--config.b2=1.0",), ("b2=1.0", "[0, 1)")),
    ("sft_weight_decay_negative", "train_sft.py", ("--config.weight_decay=-0.01",),
     ("weight_decay=-0.01", "[0, 1]")),
    ("sft_negative_seed", "train_sft.py", ("--config.seed=-1",), ("seed=-1", ">= 0")),
    ("sft_checkpoint_every_zero", "train_sft.py", ("--config.checkpoint.every=0",),
     ("checkpoint.every=0", ">= 1")),
    ("sft_nan", "train_sft.py", ("--config.eps=nan",), ("eps=nan", "finite")),
    ("sft_lora_negative_rank", "train_sft.py", ("--config.model.lora.rank=-1",),
     ("model.lora.rank=-1", ">= 0")),
    ("sft_lora_dropout_one", "train_sft.py",
     ("--config.model.lora.rank=4", "--config.model.lora.dropout=1.0"),
     ("model.lora.dropout=1.0", "[0, 1)")),
    ("sft_lora_target_misses", "train_sft.py",
     ("--config.model.lora.rank=4", "--config.model.lora.targets=('lm_head/w$',)"),
     ("model.lora.targets", "'lm_head/w$'", "matches none")),
    ("reward_lora", "train_reward.py", ("--config.model.lora.rank=4",),
     ("model.lora.rank=4", "reward learning", "model.lora.rank=0")),
    ("reward_zero_temperature", "train_reward.py", ("--config.temperature=0",),
     ("temperature=0", "must be > 0")),
    ("reward_top_p_above_one", "train_reward.py", ("--config.top_p=2.0",),
     ("top_p=2.0", "(0, 1]")),
    ("reward_truncate_after_past_response", "train_reward.py",
     ("--config.truncate_token=3", "--config.truncate_after=6"),
     ("truncate_after=6", "response_length=6", "no response could ever stop")),
    ("reward_negative_head_seed", "train_reward.py", ("--config.head_seed=-2",),
     ("head_seed=-2", ">= 0")),
    ("reward_norm_std_zero", "train_reward.py", ("--config.norm_target_std=0",),
     ("norm_target_std=0", "must be > 0")),
)


def _snapshot(path):
    if not path.exists():
        return None
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(path.rglob("*"))}


def _earlier_run(path):
    (path / "checkpoints" / "4").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"earlier": "run"}))
    (path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (path / "checkpoints" / "4" / "data").write_bytes(b"\x05" * 32)


def _launch(script, args, recipe, workdir):
    before = _snapshot(workdir)
    proc = subprocess.run(runs.command(script, f"--config={recipe}", f"--workdir={workdir}",
                                       *args),
                          env=runs.env(PJIT_PPO_MALLOC_TUNING="0"), capture_output=True,
                          text=True, timeout=300)
    return proc, before, _snapshot(workdir)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage_errors")
    tiny_text.save_tokenizer(str(root))
    (root / "corpus.txt").write_text("\n".join(tiny_text.sentences(40)) + "\n")
    labels = root / "labels.jsonl"
    labels.write_text("".join(json.dumps({"query": "the cat", "responses": ["sees", "eats"],
                                          "choice": 0}) + "\n" for _ in range(20)))
    recipes = {
        "train_sft.py": SFT_RECIPE.format(random=tiny_text.model_random(),
                                          corpus=str(root / "corpus.txt"), tok=str(root)),
        "train_reward.py": REWARD_RECIPE.format(random=tiny_text.model_random(),
                                                labels=str(labels), tok=str(root)),
    }
    for script, text in recipes.items():
        (root / f"{script}.recipe.py").write_text(text)
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for case_id, script, args, _ in CASES:
            workdir = root / case_id / "run"
            _earlier_run(workdir)
            jobs[case_id] = pool.submit(_launch, script, args, root / f"{script}.recipe.py",
                                        workdir)
        jobs["fresh"] = pool.submit(_launch, "train_sft.py", ("--config.lr=2.0",),
                                    root / "train_sft.py.recipe.py", root / "fresh" / "run")
        return {key: job.result() for key, job in jobs.items()}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_stage_value_out_of_range(case, outcomes):
    case_id, _, _, expect = case
    proc, before, after = outcomes[case_id]
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for fragment in expect:
        assert fragment in lines[0], (fragment, lines[0])
    assert after == before, "a refused launch changed the earlier run's files"


def test_refused_stage_launch_does_not_create_the_workdir(outcomes):
    proc, before, after = outcomes["fresh"]
    assert proc.returncode == 2 and "lr=2.0" in proc.stderr, proc.stderr[-3000:]
    assert before is None and after is None
