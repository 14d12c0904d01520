"""Reward learning from preference labels (lm-human-preferences' train_reward).

`train(config, workdir)` (also `launch/train_reward.py`, `pjit-ppo-reward`):

  labels (pjit_ppo/data/preferences.py): best-of-N or pairwise JSONL, tokenised with
    the HF tokenizer (queries left-padded to query_length, responses right-padded to
    response_length); held out: test_labels_path or test_fraction of the labels
  reward model = decoder trunk (from init_path / model.policy_path / model.random) +
    reward head N(0, 1/sqrt(d_model + 1)), gain 1, bias 0; sharded by the partition
    rules, its own optimizer state, micro-batches (gradient_accumulation_steps)
  normalise before training: gain and bias so that rewards of the *pretrained
    policy's* samples have mean 0, std 1 (pjit_ppo/reward/normalize.py)
  train: num_epochs over the labels in batches of batch_size; loss = softmax
    cross-entropy of the N rewards against the chosen index (Bradley-Terry for pairs);
    Adam (TF-style by default, eps 1e-5), lr linear to 0 over the run; gain and bias
    are not trained
  normalise after training the same way, then measure mean and std once more on fresh
    (held-out) samples and log them

Writes into WORKDIR:
  config.json      the resolved RewardLearningConfig
  metrics.jsonl    {"iteration": step, ...}: train/loss, train/accuracy, train/lr,
                   train/grad_norm every log_every steps (means since the last line);
                   test/loss, test/accuracy at step 0, every eval_every steps and at the
                   end; normalization/mean_before, normalization/std_before (raw, step 0),
                   normalization/mean_trained, normalization/std_trained (before the
                   normalisation after training), normalization/mean_after,
                   normalization/std_after (held-out samples, after it)
  tensorboard/     the same scalars
  checkpoints/<step>/  params/ (trunk + head, its gain and bias as normalised so far),
                   opt_state/, run/ every checkpoint.every steps and at the end (after
                   the final normalisation; pjit_ppo/loop.py): the same command resumes
                   exactly; SIGTERM / SIGINT finish the step, save and exit 0
  reward_model/    the reward-model directory (pjit_ppo/reward/model.py): HF config.json
                   + model.safetensors, reward_head.safetensors, reward_model.json,
                   tokenizer files. PPO uses it with reward.kind="model",
                   reward.path=WORKDIR/reward_model.
"""
from __future__ import annotations

import os
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from pjit_ppo import loop, optim, sharding, supervised
from pjit_ppo.config import ConfigError
from pjit_ppo.data import preferences
from pjit_ppo.errors import DataError
from pjit_ppo.models import heads
from pjit_ppo.reward.loss import preference_loss
from pjit_ppo.models.reward_model import reward_scores, save_reward_model, split_lm
from pjit_ppo.reward.normalize import NormSampler, normalized_head
from pjit_ppo.config import RewardLearningConfig

#: The output directory inside the work directory.
REWARD_MODEL_DIR = "reward_model"
CONSOLE_KEYS = ("train/loss", "train/accuracy", "test/accuracy", "train/lr",
                "normalization/mean_before", "normalization/std_before",
                "normalization/mean_after", "normalization/std_after")


def _split_labels(config: RewardLearningConfig):
    """(train records, test records) from the label files (DataError naming file/line)."""
    records = preferences.load_preferences(config.labels_path)
    if config.test_labels_path:
        test = preferences.load_preferences(config.test_labels_path)
        if len(test[0].responses) != len(records[0].responses):
            raise DataError(f"{test[0].where}: {len(test[0].responses)} responses per label, "
                            f"but {records[0].where} has {len(records[0].responses)}; the "
                            f"held-out labels must have as many as the training labels")
        return records, test
    n_test = max(1, int(round(len(records) * config.test_fraction)))
    if n_test >= len(records):
        raise DataError(f"{config.labels_path}: {len(records)} label(s) cannot be split into "
                        f"training and held-out sets; add labels or set test_labels_path")
    order = np.random.default_rng([config.seed, 104729]).permutation(len(records))
    return ([records[i] for i in sorted(order[n_test:])],
            [records[i] for i in sorted(order[:n_test])])


def _arrays(prefs: preferences.Preferences, pad_id: int) -> Dict[str, np.ndarray]:
    return {"query": prefs.query, "query_mask": prefs.query != pad_id,
            "responses": prefs.responses, "response_mask": prefs.response_mask,
            "choice": prefs.choice, "weight": np.ones(len(prefs), np.float32)}


def loss_sums(model_cfg, params, batch) -> Dict[str, jax.Array]:
    """Sums over a batch of labels: {"loss", "accuracy", "weight"} (float32 scalars).

    batch: query [B, Q], query_mask [B, Q], responses [B, N, R], response_mask
    [B, N, R], choice [B], weight float32 [B] (0 for filler rows). The head's gain and
    bias get no gradient (they are set by normalisation only).
    """
    head = dict(params["reward_head"])
    head["gain"] = jax.lax.stop_gradient(head["gain"])
    head["bias"] = jax.lax.stop_gradient(head["bias"])
    rewards = reward_scores(model_cfg, {**params, "reward_head": head}, batch["query"],
                            batch["query_mask"], batch["responses"], batch["response_mask"])
    loss, correct = preference_loss(rewards, batch["choice"])
    w = batch["weight"].astype(jnp.float32)
    return {"loss": jnp.sum(loss * w), "accuracy": jnp.sum(correct * w), "weight": jnp.sum(w)}


def _check_sizes(config: RewardLearningConfig, mesh, n_train: int) -> None:
    devices = supervised.batch_devices(mesh)
    micro = config.batch_size // config.gradient_accumulation_steps
    for name, value in (("micro-batch size (batch_size / gradient_accumulation_steps)", micro),
                        ("norm_batch_size", config.norm_batch_size)):
        if value % devices:
            raise ConfigError(f"{name} {value} is not divisible by the mesh's {devices} batch "
                              f"devices (mesh.data x mesh.fsdp); change it or the mesh")
    if n_train < config.batch_size:
        raise DataError(f"{config.labels_path}: {n_train} training labels, fewer than "
                        f"batch_size={config.batch_size}; lower batch_size or add labels")


def _norm_queries(config: RewardLearningConfig, tokenizer, train_records) -> np.ndarray:
    from pjit_ppo.data.prompts import load_prompt_texts, tokenize_queries
    if config.norm_prompts_path:
        texts = load_prompt_texts(config.norm_prompts_path, config.norm_prompts_format,
                                  config.norm_prompt_field)
    else:
        texts = [r.query for r in train_records]
    return tokenize_queries(texts, tokenizer, config.query_length, config.pad_token_id,
                            config.start_text, config.end_text)


def _load_models(config: RewardLearningConfig, mesh):
    """(reward ModelConfig, trainable trunk + head, LM head aside, policy ModelConfig,
    frozen policy)."""
    from pjit_ppo.models import assemble
    from pjit_ppo.loading import load_lm
    reward_cfg, lm = load_lm(config.model, config.reward_init_path, mesh, config.seed)
    if config.reward_init_path == config.model.policy_path:  # the same model: no second load
        policy_cfg, policy = reward_cfg, assemble.make_frozen(lm, reward_cfg.compute_dtype)
    else:
        policy_cfg, fp32 = load_lm(config.model, config.model.policy_path, mesh, config.seed)
        policy = assemble.make_frozen(fp32, policy_cfg.compute_dtype)
        jax.tree.map(lambda x: x.delete(), fp32)
    trunk, lm_head = split_lm(lm)
    head = heads.init_reward_head(reward_cfg.d_model, jax.random.PRNGKey(config.head_seed))
    trunk.update(jax.device_put(head, sharding.replicated(mesh)))
    return reward_cfg, trunk, lm_head, policy_cfg, policy


def _with_head(params, head, mesh):
    return {**params, "reward_head": jax.device_put(
        {k: jnp.asarray(v, jnp.float32) for k, v in head.items()}, sharding.replicated(mesh))}


def train(config: RewardLearningConfig, workdir: str) -> Dict[str, Any]:
    """Trains (or resumes training) a reward model; writes WORKDIR/{config.json,
    metrics.jsonl, tensorboard/, checkpoints/, reward_model/} (module docstring).

    Returns the final metrics: train/loss, train/accuracy (last log window), test/loss,
    test/accuracy (end), test/accuracy_initial (before training), the normalization/*
    values that were measured, "steps", and "reward_model_dir" (the output directory);
    after a SIGTERM / SIGINT only {"preempted": True, "steps": steps done} (a
    checkpoint was saved; the same call continues). Raises ConfigError / DataError
    before any compile for bad values or labels (or a resume with another config or
    labels), and NonFiniteError if the loss or gradient stops being finite.
    """
    from pjit_ppo.data.prompts import check_tokenizer, load_tokenizer
    from pjit_ppo.loading import copy_tokenizer, lm_config, write_config

    config.validate()
    train_records, test_records = _split_labels(config)
    tokenizer_path = config.tokenizer_path or config.model.policy_path
    tokenizer = load_tokenizer(tokenizer_path)
    shape = dict(query_length=config.query_length, response_length=config.response_length,
                 pad_id=config.pad_token_id, start_text=config.start_text,
                 end_text=config.end_text)
    train_set = preferences.tokenize_preferences(train_records, tokenizer, **shape)
    test_set = preferences.tokenize_preferences(test_records, tokenizer, **shape)
    norm_queries = _norm_queries(config, tokenizer, train_records)
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    _check_sizes(config, mesh, len(train_set))
    vocab_size = min(lm_config(config.model, path).vocab_size
                     for path in (config.reward_init_path, config.model.policy_path))
    check_tokenizer(tokenizer, path=tokenizer_path, vocab_size=vocab_size,
                    pad_id=config.pad_token_id, stop_token=config.truncate_token)
    train_arrays = _arrays(train_set, config.pad_token_id)
    test_arrays = _arrays(test_set, config.pad_token_id)
    checkpoints = loop.Checkpoints(workdir, config, {
        "training": loop.fingerprint(train_arrays), "held-out": loop.fingerprint(test_arrays),
        "normalisation prompt": loop.fingerprint({"query": norm_queries})})
    reward_cfg, params, lm_head, policy_cfg, policy = _load_models(config, mesh)
    write_config(config, workdir)

    steps_per_epoch = len(train_set) // config.batch_size
    total = steps_per_epoch * config.num_epochs
    optimizer = optim.make_optimizer(learning_rate=config.lr, num_updates=total,
                                     anneal_lr=True, kind=config.optimizer, eps=config.eps,
                                     max_grad_norm=config.max_grad_norm)
    opt_state = supervised.init_opt_state(optimizer, params, mesh)

    def loss_fn(p, batch):
        sums = loss_sums(reward_cfg, p, batch)
        return sums["loss"], sums
    # What the loss and optimizer close over (supervised.py: the program cache).
    description = repr(("reward", config.to_dict(), reward_cfg, total))
    eval_fn = supervised.make_eval_step(loss_fn, mesh, description=description)
    sampler = NormSampler(config, policy_cfg, policy, reward_cfg, mesh, norm_queries)
    micro = config.batch_size // config.gradient_accumulation_steps

    def test(params):
        stats = supervised.evaluate(eval_fn, params, mesh, supervised.padded_batches(
            test_arrays, micro, "weight"))
        return {"test/loss": stats["loss"], "test/accuracy": stats["accuracy"]}

    def normalize(params, round_, label):
        """params with the head set from a measurement (round_), and its metric line."""
        mean, std = sampler.measure(params, round_)
        head = normalized_head(params["reward_head"], mean, std, config.norm_target_mean,
                               config.norm_target_std)
        return (_with_head(params, head, mesh),
                {f"normalization/mean_{label}": mean, f"normalization/std_{label}": std})

    def before(params):
        if not config.normalize_before:
            return params, []
        params, line = normalize(params, 0, "before")
        return params, [line]

    def after(params):
        if not config.normalize_after:
            return params, []
        params, trained = normalize(params, 1, "trained")
        mean, std = sampler.measure(params, 2)  # fresh samples: how well it worked
        return params, [trained, {"normalization/mean_after": mean,
                                  "normalization/std_after": std}]

    stage = loop.Stage(
        name="reward learning", mesh=mesh,
        step_fn=supervised.make_train_step(loss_fn, optimizer, params, opt_state, mesh,
                                           description=description),
        train_arrays=train_arrays, batch_size=config.batch_size,
        micro_batches=config.gradient_accumulation_steps, seed=config.seed,
        shuffle_tag="reward", total_steps=total,
        train_metrics=(("train/loss", "loss"), ("train/accuracy", "accuracy"),
                       ("train/grad_norm", "grad_norm")),
        lr=lambda _, opt_state: float(jax.device_get(optim.current_lr(opt_state))),
        evaluate=test, log_every=config.log_every, eval_every=config.eval_every,
        console_keys=CONSOLE_KEYS, begin=before, finish=after)
    logging.info("reward learning: %d training labels (%d responses each), %d held out, "
                 "%d steps of %d", len(train_set), train_set.responses.shape[1],
                 len(test_set), total, config.batch_size)
    out = loop.fit(stage, params, opt_state, workdir=workdir, checkpoints=checkpoints,
                   tensorboard=config.tensorboard)
    if out.preempted:
        return {"preempted": True, "steps": out.steps}
    progress = out.progress
    result: Dict[str, Any] = dict(progress.begun)
    result["test/accuracy_initial"] = progress.first_eval["test/accuracy"]
    result.update({k: progress.last_train[k] for k in ("train/loss", "train/accuracy")})
    result.update(progress.last_eval)
    result.update(progress.finished)

    out_dir = os.path.join(workdir, REWARD_MODEL_DIR)
    info = {"format": "pjit_ppo reward model", "query_length": config.query_length,
            "response_length": config.response_length, "pad_token_id": config.pad_token_id,
            "labels_path": config.labels_path, "num_labels": len(train_set),
            "responses_per_label": int(train_set.responses.shape[1]), "steps": total,
            "metrics": {k: v for k, v in result.items() if isinstance(v, float)}}
    save_reward_model(out_dir, reward_cfg, out.params, lm_head, info, dtype=config.save_dtype)
    copy_tokenizer(tokenizer_path, out_dir)
    logging.info("reward model saved to %s (held-out accuracy %.3f)", out_dir,
                 result.get("test/accuracy", float("nan")))
    result.update(steps=total, reward_model_dir=out_dir)
    return result
