"""The demo's stage configs, from its work directory (configs/demo_*.py call these).

Every stage is the code path a real run takes (the SFT, reward-learning and PPO entry
points accept these configs); only the data, the sizes and the step counts are the
demo's. Paths inside the demo's work directory:

  DIR/data/        corpus and prompt files, tokenizer/
  DIR/sft/         the SFT run; DIR/sft/model/ is the pretrained policy
  DIR/labels/      labels.jsonl and labels_test.jsonl (best-of-4, noisy VADER labeller)
  DIR/reward/      the reward-learning run; DIR/reward/reward_model/ is the reward model
  DIR/ppo/         the PPO run (checkpoints, metrics.jsonl, samples.jsonl, eval/)
  DIR/dpo/         the DPO run on the same labels from the same SFT policy (--algo=dpo or
                   all); DIR/dpo/model/ is the DPO policy, DIR/dpo/eval/ its gold scores
"""
import dataclasses
import os

from pjit_ppo.config import (CheckpointOptions, DataOptions, EvalOptions, ModelOptions,
                             PPOConfig, RewardOptions, RunConfig)
from pjit_ppo.config import DPOConfig, RewardLearningConfig, SFTConfig

#: The policy: a small GPT-J-architecture decoder (random init; SFT trains it).
MODEL = dict(model_type="gptj", vocab_size=648, n_embd=128, n_layer=2, n_head=4,
             rotary_dim=16, n_positions=64, bos_token_id=0, eos_token_id=0)
QUERY_LENGTH = 6       # tokens of a prompt (the first noun phrase: 2-3 words)
RESPONSE_LENGTH = 16   # tokens of a continuation (a sentence ends within about 14)
PAD_ID = 1             # the demo tokenizer's <pad> (demo/tokenizer.py: special tokens first)
STOP_ID_FILE = "stop_token_id.txt"  # the tokenizer's id of " ." (written by the pipeline)
TEMPERATURE = 1.0      # sampling temperature of labels, normalisation and PPO
DPO_BETA = 0.5         # DPO's KL weight (0.1 learns faster on the demo but garbles more samples)
DPO_LR = 1e-4          # DPO's peak learning rate (Adam, annealed linearly to 0)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Stage sizes; `quick` is the shortened run tests use."""

    sentences: int = 6000
    heldout: int = 600
    sft_epochs: int = 3
    labels: int = 3072
    test_labels: int = 384
    ppo_iterations: int = 60
    eval_prompts: int = 256
    dpo_epochs: int = 2


FULL = Sizes()
QUICK = Sizes(sentences=1200, heldout=200, sft_epochs=1, labels=256, test_labels=64,
              ppo_iterations=4, eval_prompts=64, dpo_epochs=4)


def paths(workdir: str) -> dict:
    """Every path of the demo's work directory by name."""
    d = os.path.abspath(workdir)
    data = os.path.join(d, "data")
    return {
        "root": d, "data": data, "tokenizer": os.path.join(data, "tokenizer"),
        "corpus_train": os.path.join(data, "corpus_train.txt"),
        "corpus_heldout": os.path.join(data, "corpus_heldout.txt"),
        "prompts_train": os.path.join(data, "prompts_train.jsonl"),
        "prompts_heldout": os.path.join(data, "prompts_heldout.jsonl"),
        "stop_token": os.path.join(data, STOP_ID_FILE),
        "sft": os.path.join(d, "sft"), "policy": os.path.join(d, "sft", "model"),
        "labels_dir": os.path.join(d, "labels"),
        "labels": os.path.join(d, "labels", "labels.jsonl"),
        "labels_test": os.path.join(d, "labels", "labels_test.jsonl"),
        "reward": os.path.join(d, "reward"),
        "reward_model": os.path.join(d, "reward", "reward_model"),
        "ppo": os.path.join(d, "ppo"),
        "dpo": os.path.join(d, "dpo"), "dpo_model": os.path.join(d, "dpo", "model"),
        "dpo_eval": os.path.join(d, "dpo", "eval"),
    }


def _split(arg: str):
    """"DIR" or "DIR,quick" -> (DIR, Sizes)."""
    workdir, _, size = (arg or "/tmp/pjit_ppo_demo").partition(",")
    return workdir, QUICK if size == "quick" else FULL


def stop_token_id(workdir: str) -> int:
    """The tokenizer's id of " ." (the sentence end), once the data stage has written it."""
    path = paths(workdir)["stop_token"]
    if not os.path.exists(path):
        return 0  # before the data stage: any valid id (validation only)
    with open(path) as f:
        return int(f.read())


def sft(arg: str = "") -> SFTConfig:
    """Pretraining of the policy on the corpus (next-token loss, AdamW, cosine decay)."""
    workdir, sizes = _split(arg)
    p = paths(workdir)
    return SFTConfig(model=ModelOptions(random=dict(MODEL)), data_path=p["corpus_train"],
                     eval_path=p["corpus_heldout"], tokenizer_path=p["tokenizer"],
                     seq_length=24, batch_size=64, num_epochs=sizes.sft_epochs, lr=2e-3,
                     warmup_steps=20, lr_decay="cosine", end_lr_fraction=0.05,
                     weight_decay=0.01, log_every=20, eval_every=100, seed=0,
                     checkpoint=CheckpointOptions(every=200))


def reward(arg: str = "") -> RewardLearningConfig:
    """Reward learning from the labeller's best-of-4 choices (lm-human-preferences' loss,
    schedule and normalisation), starting from the SFT policy."""
    workdir, _ = _split(arg)
    p = paths(workdir)
    return RewardLearningConfig(
        model=ModelOptions(policy_path=p["policy"]), labels_path=p["labels"],
        test_labels_path=p["labels_test"], tokenizer_path=p["tokenizer"],
        query_length=QUERY_LENGTH, response_length=RESPONSE_LENGTH, pad_token_id=PAD_ID,
        temperature=TEMPERATURE, truncate_token=stop_token_id(workdir), truncate_after=2,
        num_epochs=2, batch_size=32, lr=3e-4, log_every=10, eval_every=40,
        norm_samples=256, norm_prompts_path=p["prompts_train"], seed=0,
        checkpoint=CheckpointOptions(every=200))


def ppo(arg: str = "") -> RunConfig:
    """PPO of the SFT policy against the learned reward model (critic from it)."""
    workdir, sizes = _split(arg)
    p = paths(workdir)
    return RunConfig(
        model=ModelOptions(policy_path=p["policy"]),
        reward=RewardOptions(kind="model", path=p["reward_model"]),
        data=DataOptions(prompts_path=p["prompts_train"], eval_prompts_path=p["prompts_heldout"],
                         tokenizer_path=p["tokenizer"], samples_every=5, samples_per_table=64),
        ppo=PPOConfig(query_length=QUERY_LENGTH, response_length=RESPONSE_LENGTH,
                      batch_size=64, nminibatches=2, noptepochs=4,
                      total_episodes=64 * sizes.ppo_iterations, temperature=TEMPERATURE,
                      truncate_token=stop_token_id(workdir), truncate_after=2,
                      penalty_reward_value=-1.0, lr=1e-4, init_kl_coef=0.05,
                      kl_controller="fixed", critic_init="reward", pad_token_id=PAD_ID,
                      seed=1),
        checkpoint=CheckpointOptions(every=20),
        evaluation=EvalOptions(num_prompts=sizes.eval_prompts, seed=0),
        measure_peak=False,  # no MFU figures: the demo's seconds go to learning
    )


def dpo(arg: str = "") -> DPOConfig:
    """DPO of the SFT policy on the labeller's best-of-4 choices (3 pairs per label), the
    labels reward learning reads; the reference is the SFT policy."""
    workdir, sizes = _split(arg)
    p = paths(workdir)
    return DPOConfig(
        model=ModelOptions(policy_path=p["policy"]), labels_path=p["labels"],
        test_labels_path=p["labels_test"], tokenizer_path=p["tokenizer"],
        query_length=QUERY_LENGTH, response_length=RESPONSE_LENGTH, pad_token_id=PAD_ID,
        temperature=TEMPERATURE, truncate_token=stop_token_id(workdir), truncate_after=2,
        beta=DPO_BETA, loss_type="sigmoid", batch_size=64, num_epochs=sizes.dpo_epochs,
        lr=DPO_LR, log_every=10, eval_every=50, seed=0,
        checkpoint=CheckpointOptions(every=100))
