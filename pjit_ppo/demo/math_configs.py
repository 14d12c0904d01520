"""The math demo's GRPO config and paths, from its work directory (configs/demo_math.py
calls these).

The demo trains a real pretrained model (SmolLM2-135M-Instruct by default) with GRPO on
procedural arithmetic word problems (`pjit_ppo.demo.arithmetic`), rewarded by Python
functions on the decoded answers (`pjit_ppo.rewards.functions`): exact match of the
final number against the record's `answer` (weight 1) plus a format bonus for ending
with "The answer is N." (weight FORMAT_WEIGHT). Paths inside the work directory:

  DIR/model/       the fetched GGUF file, and MODEL_PATH (the path of the model used)
  DIR/data/        train.jsonl and eval.jsonl (chat-formatted prompts + answer metadata),
                   special_ids.json (pad / stop ids and the query length)
  DIR/grpo/        the GRPO run (checkpoints, metrics.jsonl, samples.jsonl, eval/)
"""
from __future__ import annotations

import dataclasses
import json
import os

from pjit_ppo.config import (CheckpointOptions, DataOptions, EvalOptions, ModelOptions,
                             PPOConfig, PPORunConfig, RewardOptions)

#: The reward: exact match of the final answer, and a small bonus for the asked format.
FORMAT_WEIGHT = 0.2
REWARD_TERMS = (
    "correct:function:1.0:pjit_ppo.rewards.functions:exact_match",
    f"format:function:{FORMAT_WEIGHT}:pjit_ppo.rewards.functions:format_check_final",
)
#: The system message of every prompt (shorter than SmolLM2's 20-token default).
SYSTEM = "You are a helpful assistant."
DIFFICULTY = "add2"    # two-digit additions in words (pjit_ppo.demo.arithmetic.LEVELS)
ONE_SHOT = True        # a worked example before each problem (greedy accuracy of the
#                        base 11% -> 30%; without it GRPO taught the answer's form in 7
#                        iterations and no correct answer in 10)
SAMPLES_PER_PROMPT = 4  # GRPO's group size
RESPONSE_LENGTH = 32   # new tokens per answer (the one-shot answers take about 20)
TEMPERATURE = 0.3      # GRPO's sampling temperature: near the greedy answer the held-out
#                        accuracy measures (at 0.7 the base's samples are right 6% of the
#                        time against 28% greedy; most groups then carry no signal)
LR = 1e-5              # Adam, no annealing within the short run (3e-5 collapsed the
#                        policy's entropy: held-out accuracy 0.34 -> 0.22, KL 12.5)
KL_LOSS_COEF = 0.1     # GRPO's KL penalty in the loss (0.04 let the KL reach 12.5)
DATA_SEED = 0


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much the demo does; `quick` is the shortened run of the tests."""

    iterations: int = 12         # GRPO iterations
    prompts_per_iteration: int = 8  # problems per iteration (x SAMPLES_PER_PROMPT samples)
    noptepochs: int = 1          # passes over each iteration's samples (fresh samples
    #                              teach more per second than a second pass)
    minibatches: int = 1         # optimizer steps per pass (at lr 3e-5, 2 did worse:
    #                              0.297 -> 0.318 in 14 iterations against 0.406 in 12)
    train_problems: int = 512    # the training split (the run uses the first ones it draws)
    eval_problems: int = 384     # held-out problems (greedy accuracy before and after;
    #                              384 puts the binomial standard error near 0.025)
    checkpoint_every: int = 4


FULL = Sizes()
QUICK = Sizes(iterations=2, prompts_per_iteration=4, noptepochs=1, minibatches=1,
              train_problems=32,
              eval_problems=16, checkpoint_every=1)


def split_arg(arg: str):
    """"DIR" or "DIR,quick" -> (DIR, Sizes)."""
    workdir, _, size = (arg or "/tmp/pjit_ppo_demo_math").partition(",")
    return workdir, QUICK if size == "quick" else FULL


def paths(workdir: str) -> dict:
    """Every path of the math demo's work directory by name."""
    d = os.path.abspath(workdir)
    data = os.path.join(d, "data")
    return {"root": d, "model_dir": os.path.join(d, "model"),
            "model_path_file": os.path.join(d, "model", "MODEL_PATH"),
            "data": data, "train": os.path.join(data, "train.jsonl"),
            "eval": os.path.join(data, "eval.jsonl"),
            "special_ids": os.path.join(data, "special_ids.json"),
            "grpo": os.path.join(d, "grpo")}


def model_path(workdir: str) -> str:
    """The model the demo trains, as its model stage wrote it down (before that stage ran:
    where it puts the fetched SmolLM2 file)."""
    path = paths(workdir)["model_path_file"]
    if not os.path.exists(path):
        from pjit_ppo.demo.fetch_model import GGUF_NAME
        return os.path.join(paths(workdir)["model_dir"], GGUF_NAME)
    with open(path) as f:
        return f.read().strip()


def special_ids(workdir: str) -> dict:
    """{"pad", "stop", "query_length"} from the data stage (placeholders before it ran)."""
    path = paths(workdir)["special_ids"]
    if not os.path.exists(path):
        return {"pad": 0, "stop": 0, "query_length": 8}
    with open(path) as f:
        return json.load(f)


def grpo(arg: str = "") -> PPORunConfig:
    """GRPO of the pretrained model on the training problems; the reference is the model
    itself, the evaluation greedy on the held-out problems."""
    workdir, sizes = split_arg(arg)
    p, ids = paths(workdir), special_ids(workdir)
    batch = sizes.prompts_per_iteration * SAMPLES_PER_PROMPT
    return PPORunConfig(
        model=ModelOptions(policy_path=model_path(workdir), compute_dtype="float32",
                           remat_policy="full"),
        reward=RewardOptions(kind="terms", terms=REWARD_TERMS),
        data=DataOptions(prompts_path=p["train"], eval_prompts_path=p["eval"],
                         samples_every=1, samples_per_table=8),
        ppo=PPOConfig(
            advantage_estimator="grpo", samples_per_prompt=SAMPLES_PER_PROMPT,
            loss_aggregation="sequence_mean", query_length=ids["query_length"],
            response_length=RESPONSE_LENGTH, batch_size=batch, nminibatches=sizes.minibatches,
            noptepochs=sizes.noptepochs, total_episodes=batch * sizes.iterations,
            temperature=TEMPERATURE, pad_token_id=ids["pad"], truncate_token=ids["stop"],
            truncate_after=0, penalty_reward_value=0.0, optimizer="adam", lr=LR, eps=1e-8,
            anneal_lr=False, max_grad_norm=1.0, kl_loss_coef=KL_LOSS_COEF, init_kl_coef=0.0,
            kl_controller="fixed", seed=1),
        checkpoint=CheckpointOptions(every=sizes.checkpoint_every, keep=1),
        # No KL in the evaluation: two passes fewer over every held-out answer (the
        # training KL is in metrics.jsonl and summary.json's kl_final).
        evaluation=EvalOptions(num_prompts=sizes.eval_problems, greedy=True, seed=0,
                               kl=False),
        num_iterations=sizes.iterations,
        tensorboard=False,
        measure_peak=False,  # no MFU figures: the demo's seconds go to learning
    )
