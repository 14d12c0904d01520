"""Evaluate a checkpoint: the policy against the reference policy on held-out prompts.

Restores only the policy parameters of one checkpoint (no optimizer state is read; a
run with LoRA adapters: the adapters, merged into its base model after checking the
base's fingerprint, `pjit_ppo.lora_checkpoints`),
samples one response per prompt from the policy and from the reference policy (the
run's initial policy), scores both with the run's reward and post-processing, and
measures the KL of the policy to the reference on the policy's samples. Writes
WORKDIR/eval/<step>/eval.json and samples.jsonl.

A reward with Python functions (reward.kind=function or terms holding one) runs as in
training: one compiled program samples both policies, the host calls each function
once per policy on every held-out row with its prompt record, and a second program
scores and measures the KL. A reward of weighted terms adds each term's mean for the
policy and the reference to eval.json (`terms`) and each row's term scores to
samples.jsonl (`policy_terms`, `reference_terms`); prompt records with metadata add it
to each row (`metadata`).
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from pjit_ppo import (checkpoint, distributed, lora_checkpoints, param_makers, rewards, rng,
                      sample_table, sampling, sharding)
from pjit_ppo.config import ConfigError, RunConfig, resume_conflicts
from pjit_ppo.config.sections import DEFAULT_EVAL_PROMPTS
from pjit_ppo.loading import load_lm
from pjit_ppo.models import assemble, scoring
from pjit_ppo.ppo.run import make_prompts, resolve_token_ids
from pjit_ppo.rewards.responses import score_responses, truncate_responses

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


def _host_scores(functions, prompts, cfg, mesh, response: jax.Array) -> jax.Array:
    """The reward's Python functions' scores float32 [B, H] of sampled responses int32
    [B, R] of the held-out prompts, batch-sharded like the rollout's. Every process
    scores every row (the prompt set is small) and keeps its own."""
    scorer = rewards.HostScorer(functions, prompts, samples_per_prompt=1)
    _, _, kept = jax.jit(lambda r: truncate_responses(cfg, r))(response)
    response, kept = distributed.host_array(response), distributed.host_array(kept)
    scores = scorer(0, np.arange(len(response)), response, kept)
    return jax.make_array_from_callback(scores.shape, sharding.batch_sharding(mesh, 2),
                                        lambda index: scores[index])


def evaluate(config: RunConfig, workdir: str, step: Optional[int] = None) -> Dict[str, Any]:
    """Evaluates checkpoint `step` (latest complete when None) of the run in `workdir`.

    Returns the eval.json dict: checkpoint_step, num_prompts, prompt_set_size,
    prompts_repeat, reward_mean, reward_std, reference_reward_mean, kl_mean (null with
    evaluation.kl=False), win_rate_vs_reference, temperature, greedy.
    """
    resolve_token_ids(config)
    ckpt = checkpoint.RunCheckpointer(workdir, config.checkpoint, read_only=True)
    step, run_info = ckpt.resolve(step)
    _check_matches(run_info["config"], config, step)
    cfg, ev = config.ppo, config.evaluation
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    policy_cfg, initial = load_lm(config.model, config.model.policy_path, mesh, cfg.seed)
    reference = assemble.make_frozen(initial, policy_cfg.compute_dtype)
    adapted = lora_checkpoints.adapted_config(config.model, policy_cfg)
    if adapted is not None:  # LoRA: the checkpoint's adapters merged into the base
        policy = lora_checkpoints.merged_policy(ckpt, step, run_info, adapted, initial, mesh)
    else:
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), initial)
        jax.tree.map(lambda x: x.delete(), initial)
        _, policy = ckpt.restore_policy(step, target)
    reward = rewards.build(config, param_makers.Loaded(mesh))
    reward_fn, reward_params = reward.fn, reward.params
    functions = rewards.host_functions(reward_fn)
    del reward  # the fp32 trunk (a critic's starting point) is not needed here

    temperature = ev.temperature or cfg.temperature
    # Held-out prompts: data.eval_prompts_path (or the training prompts in an order of
    # their own), or random tokens from their own stream.
    prompts, num_prompts, set_size = _eval_prompts(config, mesh, policy_cfg.vocab_size)
    query, query_mask = prompts(0)
    policy_key, reference_key = jax.random.split(rng.stream_key(ev.seed, "eval_sample", step))

    def sample(params, key, query, query_mask):
        return sampling.generate(policy_cfg, params, query, query_mask, key,
                                 max_new_tokens=cfg.response_length, temperature=temperature,
                                 top_k=cfg.top_k, top_p=cfg.top_p, top_p_mode=cfg.top_p_mode,
                                 greedy=ev.greedy, mesh=mesh)[0]

    def sample_both(policy, reference, query, query_mask, policy_key, reference_key):
        return (sample(policy, policy_key, query, query_mask),
                sample(reference, reference_key, query, query_mask))

    def score(policy, reference, reward_params, query, query_mask, response, ref_response,
              host=(None, None)):
        """(scores, reference scores, KL [B], terms, reference terms) of the samples."""
        scored = score_responses(cfg, reward_fn, reward_params, query, query_mask, response,
                                 host[0])
        ref_scored = score_responses(cfg, reward_fn, reward_params, query, query_mask,
                                     ref_response, host[1])
        if not ev.kl:
            return scored[0], ref_scored[0], None, scored[3], ref_scored[3]
        kl = (scoring.response_logprobs(policy_cfg, policy, query, query_mask, response,
                                        temperature)
              - scoring.response_logprobs(policy_cfg, reference, query, query_mask, response,
                                          temperature))
        return scored[0], ref_scored[0], jnp.sum(kl, axis=1), scored[3], ref_scored[3]

    if functions:  # sampling, the host's Python functions, scoring: two programs
        samples = jax.jit(sample_both)(policy, reference, query, query_mask, policy_key,
                                       reference_key)
        host = tuple(_host_scores(functions, prompts, cfg, mesh, x) for x in samples)
        out = samples + jax.jit(score)(policy, reference, reward_params, query, query_mask,
                                       *samples, host)
    else:
        @jax.jit
        def run(policy, reference, reward_params, query, query_mask, policy_key,
                reference_key):
            samples = sample_both(policy, reference, query, query_mask, policy_key,
                                  reference_key)
            return samples + score(policy, reference, reward_params, query, query_mask,
                                   *samples)
        out = run(policy, reference, reward_params, query, query_mask, policy_key,
                  reference_key)
    # Batch-sharded over all processes' devices: gathered whole on every process.
    response, ref_response, scores, ref_scores, kl, terms, ref_terms = (
        None if x is None else distributed.host_array(x) for x in out)
    result = {
        "checkpoint_step": step,
        "num_prompts": num_prompts,
        "prompt_set_size": set_size,  # None: random token prompts
        "prompts_repeat": set_size is not None and num_prompts > set_size,
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std()),
        "reference_reward_mean": float(ref_scores.mean()),
        "kl_mean": None if kl is None else float(kl.mean()),  # evaluation.kl=False: null
        "win_rate_vs_reference": win_rate(scores, ref_scores),
        "temperature": temperature,
        "greedy": ev.greedy,
    }
    names = tuple(getattr(reward_fn, "names", ()))
    if terms is not None:  # a reward of weighted terms: each term's own mean
        result["terms"] = {name: {"policy_mean": float(terms[:, j].mean()),
                                  "reference_mean": float(ref_terms[:, j].mean())}
                           for j, name in enumerate(names)}
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

    metadata = (prompts.records(0, range(num_prompts), 1)[1]
                if getattr(prompts, "fields", ()) else {})

    def row_extras(i):
        """A row's prompt-record fields and, for a reward of terms, each term's score."""
        extras = {"metadata": {k: v[i] for k, v in metadata.items()}} if metadata else {}
        if terms is not None:
            extras["policy_terms"] = {n: float(terms[i, j]) for j, n in enumerate(names)}
            extras["reference_terms"] = {n: float(ref_terms[i, j]) for j, n in enumerate(names)}
        return extras

    with open(os.path.join(out_dir, "samples.jsonl.tmp"), "w") as f:
        for i in range(num_prompts):
            f.write(json.dumps({
                "prompt": shown(q[i][m[i]], truncate=False),
                "policy_response": shown(response[i]),
                "reference_response": shown(ref_response[i]),
                "policy_reward": float(scores[i]), "reference_reward": float(ref_scores[i]),
                "kl": None if kl is None else float(kl[i]), **row_extras(i)}, ensure_ascii=False) + "\n")
    os.replace(os.path.join(out_dir, "samples.jsonl.tmp"), os.path.join(out_dir, "samples.jsonl"))
    with open(os.path.join(out_dir, "eval.json.tmp"), "w") as f:
        json.dump(result, f, indent=2)
    os.replace(os.path.join(out_dir, "eval.json.tmp"), os.path.join(out_dir, "eval.json"))
    return result
