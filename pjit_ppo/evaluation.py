"""Evaluate a checkpoint: the policy against the reference policy on held-out prompts.

Restores only the policy parameters of one checkpoint (no optimizer state is read),
samples one response per prompt from the policy and from the reference policy (the
run's initial policy), scores both with the run's reward and post-processing, and
measures the KL of the policy to the reference on the policy's samples. Writes
WORKDIR/eval/<step>/eval.json and samples.jsonl.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from pjit_ppo import (checkpoint, distributed, param_makers, rewards, rng, sample_table,
                      sampling, sharding)
from pjit_ppo.config import ConfigError, RunConfig, resume_conflicts
from pjit_ppo.config.sections import DEFAULT_EVAL_PROMPTS
from pjit_ppo.loading import load_lm
from pjit_ppo.models import assemble, scoring
from pjit_ppo.ppo.run import make_prompts, resolve_token_ids
from pjit_ppo.rewards.responses import score_responses

#: Config fields that must equal the checkpoint's: they define the models and the reward.
MODEL_FIELDS = ("model.", "reward.")


def _check_matches(saved: Dict[str, Any], config: RunConfig, step: int) -> None:
    conflicts = {k: v for k, v in resume_conflicts(saved, config.to_dict()).items()
                 if k.startswith(MODEL_FIELDS)}
    if conflicts:
        listed = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in conflicts.items())
        raise ConfigError(f"the config does not describe the models of checkpoint {step}: "
                          f"{listed}")


def win_rate(policy_scores: np.ndarray, reference_scores: np.ndarray) -> float:
    """Fraction of prompts where the policy's response scores higher; ties count half."""
    p, r = np.asarray(policy_scores), np.asarray(reference_scores)
    return float(np.mean((p > r) + 0.5 * (p == r)))


def _eval_prompts(config: RunConfig, mesh, vocab_size: int):
    """(PromptFn, number of prompts, size of the prompt set or None for random prompts).

    evaluation.num_prompts=0: the held-out set once (rounded down to a multiple of the
    batch devices), at most DEFAULT_EVAL_PROMPTS. A larger explicit number than the
    set holds repeats prompts, with a warning (and `prompts_repeat` in eval.json)."""
    ev = config.evaluation
    wanted = ev.num_prompts or DEFAULT_EVAL_PROMPTS

    def build(n):
        return make_prompts(config, mesh, vocab_size, purpose="eval_prompts", seed=ev.seed,
                            batch_size=n)
    prompts = build(wanted)
    texts = getattr(prompts, "texts", None)
    set_size = len(texts) if texts is not None else None
    if set_size is None or wanted <= set_size:
        return prompts, wanted, set_size
    devices = mesh.shape["data"] * mesh.shape["fsdp"]  # the batch axes
    whole = set_size // devices * devices
    if ev.num_prompts == 0 and whole > 0:
        logging.info("evaluation: the %d held-out prompts%s", whole,
                     f" of {set_size} (a multiple of {devices} batch devices)"
                     if whole < set_size else "")
        return build(whole), whole, set_size
    logging.warning("evaluation: %d prompts from a set of %d: prompts repeat (set "
                    "evaluation.num_prompts=0 to use each once)", wanted, set_size)
    return prompts, wanted, set_size


def evaluate(config: RunConfig, workdir: str, step: Optional[int] = None) -> Dict[str, Any]:
    """Evaluates checkpoint `step` (latest complete when None) of the run in `workdir`.

    Returns the eval.json dict: checkpoint_step, num_prompts, prompt_set_size,
    prompts_repeat, reward_mean, reward_std, reference_reward_mean, kl_mean,
    win_rate_vs_reference, temperature, greedy.
    """
    resolve_token_ids(config)
    ckpt = checkpoint.RunCheckpointer(workdir, config.checkpoint, read_only=True)
    step, run_info = ckpt.resolve(step)
    _check_matches(run_info["config"], config, step)
    cfg, ev = config.ppo, config.evaluation
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    policy_cfg, initial = load_lm(config.model, config.model.policy_path, mesh, cfg.seed)
    reference = assemble.make_frozen(initial, policy_cfg.compute_dtype)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          initial)
    jax.tree.map(lambda x: x.delete(), initial)
    _, policy = ckpt.restore_policy(step, target)
    reward = rewards.build(config, param_makers.Loaded(mesh))
    if rewards.host_functions(reward.fn):
        raise ConfigError(f"reward.kind={config.reward.kind!r}: evaluation does not run reward "
                          f"functions written in Python yet; the training run's "
                          f"metrics.jsonl and samples.jsonl hold their scores")
    reward_fn, reward_params = reward.fn, reward.params
    del reward  # the fp32 trunk (a critic's starting point) is not needed here

    temperature = ev.temperature or cfg.temperature
    # Held-out prompts: data.eval_prompts_path (or the training prompts in an order of
    # their own), or random tokens from their own stream.
    prompts, num_prompts, set_size = _eval_prompts(config, mesh, policy_cfg.vocab_size)
    query, query_mask = prompts(0)
    policy_key, reference_key = jax.random.split(rng.stream_key(ev.seed, "eval_sample", step))

    @jax.jit
    def run(policy, reference, reward_params, query, query_mask, policy_key, reference_key):
        def sample(params, key):
            return sampling.generate(policy_cfg, params, query, query_mask, key,
                                     max_new_tokens=cfg.response_length, temperature=temperature,
                                     top_k=cfg.top_k, top_p=cfg.top_p,
                                     top_p_mode=cfg.top_p_mode, greedy=ev.greedy, mesh=mesh)[0]
        response, ref_response = sample(policy, policy_key), sample(reference, reference_key)
        scores = score_responses(cfg, reward_fn, reward_params, query, query_mask, response)[0]
        ref_scores = score_responses(cfg, reward_fn, reward_params, query, query_mask,
                                     ref_response)[0]
        kl = (scoring.response_logprobs(policy_cfg, policy, query, query_mask, response,
                                        temperature)
              - scoring.response_logprobs(policy_cfg, reference, query, query_mask, response,
                                          temperature))
        return response, ref_response, scores, ref_scores, jnp.sum(kl, axis=1)

    out = run(policy, reference, reward_params, query, query_mask, policy_key, reference_key)
    # Batch-sharded over all processes' devices: gathered whole on every process.
    response, ref_response, scores, ref_scores, kl = (distributed.host_array(x) for x in out)
    result = {
        "checkpoint_step": step,
        "num_prompts": num_prompts,
        "prompt_set_size": set_size,  # None: random token prompts
        "prompts_repeat": set_size is not None and num_prompts > set_size,
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std()),
        "reference_reward_mean": float(ref_scores.mean()),
        "kl_mean": float(kl.mean()),
        "win_rate_vs_reference": win_rate(scores, ref_scores),
        "temperature": temperature,
        "greedy": ev.greedy,
    }
    q, m = distributed.host_array(query), distributed.host_array(query_mask)
    if not distributed.is_chief():  # process 0 writes the report
        return result
    out_dir = os.path.join(os.path.abspath(workdir), "eval", str(step))
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = getattr(prompts, "tokenizer", None)

    def shown(row, truncate=True):
        """Text as the reward saw it (cut after the stop token); raw ids without a tokenizer."""
        if tokenizer is None:
            return [int(t) for t in row]
        if truncate:
            row = sample_table.truncated(row[None], cfg.truncate_token, cfg.truncate_after,
                                         cfg.pad_token_id)[0]
        return tokenizer.decode([int(t) for t in row if t != cfg.pad_token_id])

    with open(os.path.join(out_dir, "samples.jsonl.tmp"), "w") as f:
        for i in range(num_prompts):
            f.write(json.dumps({
                "prompt": shown(q[i][m[i]], truncate=False),
                "policy_response": shown(response[i]),
                "reference_response": shown(ref_response[i]),
                "policy_reward": float(scores[i]), "reference_reward": float(ref_scores[i]),
                "kl": float(kl[i])}, ensure_ascii=False) + "\n")
    os.replace(os.path.join(out_dir, "samples.jsonl.tmp"), os.path.join(out_dir, "samples.jsonl"))
    with open(os.path.join(out_dir, "eval.json.tmp"), "w") as f:
        json.dump(result, f, indent=2)
    os.replace(os.path.join(out_dir, "eval.json.tmp"), os.path.join(out_dir, "eval.json"))
    return result
