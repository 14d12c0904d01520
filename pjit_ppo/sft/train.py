"""Supervised fine-tuning: next-token training of the decoder on a text corpus.

`train(config, workdir)` (also `launch/train_sft.py`, `pjit-ppo-sft`):

  corpus (pjit_ppo/data/corpus.py) -> rows of seq_length tokens with a loss mask
    (padding never trained; the prompt of prompt/completion records not either)
  model: model.policy_path (HF directory) or model.random, sharded on the mesh by the
    partition rules, fp32 master weights, compute in model.compute_dtype; with LoRA
    (model.lora.rank > 0) the weights stay frozen in the compute dtype and only the
    adapters train (and are checkpointed, with the base's fingerprint)
  AdamW (decay on weight matrices and embeddings), linear warm-up, cosine / linear /
    constant schedule, global-norm clipping; gradient accumulation over micro-batches
  loss = mean over the batch's trained target tokens of -log p(token | prefix)

Writes into WORKDIR:
  config.json        the resolved SFTConfig
  metrics.jsonl      strict JSON, one line per log: {"iteration": step, ...} with
                     train/loss, train/lr, train/grad_norm, train/tokens (trained target
                     tokens per step) every log_every steps, and test/loss,
                     test/perplexity at step 0, every eval_every steps and at the end
  tensorboard/       the same scalars
  checkpoints/<step>/  params/, opt_state/, run/ every checkpoint.every steps and at the
                     end (pjit_ppo/loop.py): the same command resumes exactly; SIGTERM /
                     SIGINT finish the step, save and exit 0
  model/             HF model directory (config.json + model.safetensors), loadable by
                     pjit_ppo.load_pretrained and transformers, plus the tokenizer's files;
                     with LoRA the adapters merged into the float32 base
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from pjit_ppo import loop, param_makers, rng, sharding, supervised
from pjit_ppo.config import ConfigError
from pjit_ppo.data import corpus
from pjit_ppo.errors import DataError
from pjit_ppo.models import hidden_states, lm_head_weights, lora, save_pretrained
from pjit_ppo.models.token_logprobs import head_token_logprobs
from pjit_ppo.config import SFTConfig

#: The output model directory inside the work directory.
MODEL_DIR = "model"
#: The metrics on the console line.
CONSOLE_KEYS = ("train/loss", "test/loss", "train/lr")


def token_loss_sums(model_cfg, params, batch) -> Dict[str, jax.Array]:
    """Sums over a batch of rows of the next-token loss.

    batch: ids int32 [B, L], mask bool [B, L], loss_mask bool [B, L] (see
    `corpus.Sequences`). Returns float32 scalars {"loss": sum of -log p over trained
    targets, "weight": number of trained targets}.
    """
    ids, mask = batch["ids"], batch["mask"]
    hidden = hidden_states(model_cfg, params, jnp.where(mask, ids, 0), mask)
    weight, bias, vocab_major = lm_head_weights(model_cfg, params)
    logprobs, _ = head_token_logprobs(hidden[:, :-1], weight, bias, ids[:, 1:],
                                      vocab_major=vocab_major)
    trained = batch["loss_mask"][:, 1:].astype(jnp.float32)
    return {"loss": -jnp.sum(logprobs * trained), "weight": jnp.sum(trained)}


def _loss_fn(model_cfg):
    """(params, batch[, LoRA base, dropout key]) -> (loss sum, sums); with a base, params
    are the adapters on it."""
    def fn(params, batch, base=None, key=None):
        if base is not None:
            params = lora.attach(base, params, key)
        sums = token_loss_sums(model_cfg, params, batch)
        return sums["loss"], sums
    return fn


def lr_schedule(config: SFTConfig, total_steps: int) -> optax.Schedule:
    """Step -> LR: linear warm-up from 0 over warmup_steps, then `lr_decay` to
    end_lr_fraction * lr at the last step (or constant)."""
    warmup = min(config.warmup_steps, total_steps)
    end = config.lr * config.end_lr_fraction
    rest = max(total_steps - warmup, 1)
    if config.lr_decay == "cosine":
        decay = optax.cosine_decay_schedule(config.lr, rest, alpha=config.end_lr_fraction)
    elif config.lr_decay == "linear":
        decay = optax.linear_schedule(config.lr, end, rest)
    else:
        decay = optax.constant_schedule(config.lr)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, config.lr, warmup), decay],
                                [warmup])


def _decay_mask(params):
    """True for weight matrices, embeddings and LoRA adapters (AdamW decays those only)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: sharding.path_str(path).rsplit("/", 1)[-1] in (
            "w", "embeddings", *lora.ADAPTER_NAMES), params)


def make_optimizer(config: SFTConfig, total_steps: int) -> optax.GradientTransformation:
    """[clip] -> AdamW with the schedule of `lr_schedule`."""
    parts = []
    if config.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(config.max_grad_norm))
    parts.append(optax.adamw(lr_schedule(config, total_steps), b1=config.b1, b2=config.b2,
                             eps=config.eps, weight_decay=config.weight_decay,
                             mask=_decay_mask))
    return optax.chain(*parts)


def _load_data(config: SFTConfig, tokenizer, eos_id):
    """(train Sequences, held-out Sequences)."""
    fields = dict(fmt=config.data_format, text_field=config.text_field,
                  prompt_field=config.prompt_field, completion_field=config.completion_field)
    docs = corpus.load_documents(config.data_path, **fields)
    if config.eval_path:
        eval_docs = corpus.load_documents(config.eval_path, **fields)
    else:
        order = np.random.default_rng(config.seed).permutation(len(docs))
        n_eval = max(1, int(round(len(docs) * config.eval_fraction)))
        if n_eval >= len(docs):
            raise DataError(f"{config.data_path}: {len(docs)} document(s) cannot be split "
                            f"into training and held-out sets; add data or set eval_path")
        eval_docs = [docs[i] for i in sorted(order[:n_eval])]
        docs = [docs[i] for i in sorted(order[n_eval:])]

    def rows(documents, source):
        seqs = corpus.make_sequences(corpus.tokenize_documents(documents, tokenizer, eos_id),
                                     config.seq_length, config.packing)
        if not len(seqs):
            raise DataError(f"{source}: no document has 2 or more tokens (nothing to predict)")
        return seqs
    train = rows(docs, config.data_path)
    held_out = rows(eval_docs, config.eval_path or config.data_path)
    return train, held_out.take(slice(0, config.max_eval_examples))


def _check_sizes(config: SFTConfig, mesh, n_train: int, vocab_size: int, tokenizer,
                 tokenizer_path: str) -> None:
    micro = config.batch_size // config.gradient_accumulation_steps
    devices = supervised.batch_devices(mesh)
    if micro % devices:
        raise ConfigError(f"micro-batch size {micro} (batch_size / gradient_accumulation_steps)"
                          f" is not divisible by the mesh's {devices} batch devices (mesh.data "
                          f"x mesh.fsdp); change batch_size or the mesh")
    if n_train < config.batch_size:
        raise DataError(f"{config.data_path}: {n_train} training rows, fewer than batch_size="
                        f"{config.batch_size}; lower batch_size or add data")
    if len(tokenizer) > vocab_size:
        raise DataError(f"{tokenizer_path}: the tokenizer has {len(tokenizer)} tokens but the "
                        f"model's embedding has {vocab_size} rows; use the model's own "
                        f"tokenizer")


def _data_fingerprints(train_rows, eval_rows) -> Dict[str, str]:
    return {name: loop.fingerprint(rows._asdict())
            for name, rows in (("training", train_rows), ("held-out", eval_rows))}


def train(config: SFTConfig, workdir: str) -> Dict[str, Any]:
    """Runs (or resumes) SFT; writes WORKDIR/{config.json, metrics.jsonl, tensorboard/,
    checkpoints/, model/}.

    Returns {"train/loss": mean of the last log window, "test/loss": held-out loss at
    the end, "test/loss_initial": held-out loss before training, "test/perplexity",
    "steps": optimizer steps, "model_dir": the saved HF directory}; after a SIGTERM /
    SIGINT only {"preempted": True, "steps": steps done} (a checkpoint was saved; the
    same call continues). Raises ConfigError / DataError before any compile for bad
    values or data (or a resume with another config or data), and NonFiniteError if
    the training loss or gradient stops being finite.
    """
    from pjit_ppo.data.prompts import load_tokenizer
    from pjit_ppo.loading import copy_tokenizer, lm_config, load_lm, merged_lm, write_config

    config.validate()
    tokenizer_path = config.tokenizer_path or config.model.policy_path
    tokenizer = load_tokenizer(tokenizer_path)
    eos_id = None
    if config.append_eos:
        eos_id = tokenizer.eos_token_id
        if eos_id is None:
            raise DataError(f"{tokenizer_path}: the tokenizer has no EOS token; set "
                            f"append_eos=False or give it one")
    train_rows, eval_rows = _load_data(config, tokenizer, eos_id)
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    vocab_size = lm_config(config.model, config.model.policy_path).vocab_size
    _check_sizes(config, mesh, len(train_rows), vocab_size, tokenizer, tokenizer_path)
    checkpoints = loop.Checkpoints(workdir, config, _data_fingerprints(train_rows, eval_rows))
    spec = lora.spec_from_options(config.model.lora)
    base = None  # with LoRA: the frozen base; params are then the adapters
    if spec is None:
        model_cfg, params = load_lm(config.model, config.model.policy_path, mesh, config.seed)
    else:
        model_cfg, base, params = param_makers.adapted_lm(
            param_makers.Loaded(mesh), config.model, config.model.policy_path, config.seed)
        checkpoints.check_base(lora.fingerprint(base))
    write_config(config, workdir)

    steps_per_epoch = len(train_rows) // config.batch_size
    total = config.max_steps or steps_per_epoch * config.num_epochs
    optimizer = make_optimizer(config, total)
    schedule = lr_schedule(config, total)
    opt_state = supervised.init_opt_state(optimizer, params, mesh)
    loss_fn = _loss_fn(model_cfg)
    keyed = spec is not None and spec.dropout > 0
    # What the loss and optimizer close over (supervised.py: the program cache).
    description = repr(("sft", config.to_dict(), model_cfg, total))
    eval_fn = supervised.make_eval_step(loss_fn, mesh, frozen=base, description=description)
    eval_arrays = eval_rows._asdict()
    micro = config.batch_size // config.gradient_accumulation_steps

    def held_out(params):
        stats = supervised.evaluate(eval_fn, params, mesh, supervised.padded_batches(
            eval_arrays, micro, "loss_mask"))
        return {"test/loss": stats["loss"], "test/perplexity": math.exp(min(stats["loss"], 50))}

    stage = loop.Stage(
        name="SFT", mesh=mesh,
        step_fn=supervised.make_train_step(loss_fn, optimizer, params, opt_state, mesh,
                                           frozen=base, keyed=keyed, description=description),
        train_arrays=train_rows._asdict(), batch_size=config.batch_size,
        micro_batches=config.gradient_accumulation_steps, seed=config.seed, shuffle_tag="sft",
        total_steps=total,
        train_metrics=(("train/loss", "loss"), ("train/grad_norm", "grad_norm"),
                       ("train/tokens", "weight")),
        lr=lambda step, _: float(schedule(step)), evaluate=held_out,
        log_every=config.log_every, eval_every=config.eval_every, console_keys=CONSOLE_KEYS,
        step_key=(lambda step: rng.stream_key(config.seed, "lora_dropout", step)) if keyed
        else None)
    logging.info("SFT: %d training rows, %d held-out, %d steps of %d rows (%d tokens each)",
                 len(train_rows), len(eval_rows), total, config.batch_size, config.seq_length)
    out = loop.fit(stage, params, opt_state, workdir=workdir, checkpoints=checkpoints,
                   tensorboard=config.tensorboard)
    if out.preempted:
        return {"preempted": True, "steps": out.steps}
    initial, final = out.progress.first_eval, out.progress.last_eval
    out_dir = os.path.join(workdir, MODEL_DIR)
    if spec is None:
        save_pretrained(out_dir, model_cfg, out.params, dtype=config.save_dtype)
    else:  # the adapters merged into the float32 base, read again
        jax.tree.map(lambda x: x.delete(), base)
        merged_cfg, merged = merged_lm(config.model, config.model.policy_path, mesh,
                                       config.seed, spec, out.params)
        save_pretrained(out_dir, merged_cfg, merged, dtype=config.save_dtype)
    copy_tokenizer(tokenizer_path, out_dir)
    logging.info("SFT: held-out loss %.4f -> %.4f; model saved to %s", initial["test/loss"],
                 final["test/loss"], out_dir)
    return {"train/loss": out.progress.last_train.get("train/loss", float("nan")),
            "test/loss": final["test/loss"], "test/loss_initial": initial["test/loss"],
            "test/perplexity": final["test/perplexity"], "steps": total,
            "model_dir": out_dir}
