"""Direct preference optimisation of the policy on preference labels (DPO / IPO).

`train(config, workdir)` (also `launch/train_dpo.py`, `pjit-ppo-dpo`):

  labels (pjit_ppo/data/preferences.py): best-of-N or pairwise JSONL, tokenised with the
    HF tokenizer (queries left-padded to query_length, responses right-padded to
    response_length), each label -> its (chosen, rejected) pairs (pjit_ppo/dpo/pairs.py);
    held out: test_labels_path or test_fraction of the labels
  policy: model.policy_path (HF directory) or model.random, sharded by the partition
    rules, fp32 master weights, compute in model.compute_dtype; with LoRA
    (model.lora.rank > 0) frozen in the compute dtype with trainable adapters
  reference: the initial policy, frozen in the compute dtype (with LoRA: the base the
    adapters train on, the same arrays, no copy); with precompute_ref its
    log-probs of every pair are computed before training (WORKDIR/reference_logps.npz)
    and it is freed, else it scores each batch as the batch is trained on
  loss = mean over a batch's pairs of `dpo_loss` (pjit_ppo/dpo/loss.py) on the summed
    response log-probs; Adam, lr linear to 0 over the run (or constant), global-norm
    clipping, gradient accumulation over micro-batches

Writes into WORKDIR:
  config.json          the resolved DPOConfig
  reference_logps.npz  precompute_ref: the reference's summed log-probs of every training
                       and held-out pair (read back on resume, not recomputed)
  metrics.jsonl        {"iteration": step, ...}: train/loss, train/rewards/chosen,
                       train/rewards/rejected, train/rewards/accuracies,
                       train/rewards/margins, train/logps/chosen, train/logps/rejected,
                       train/grad_norm, train/lr every log_every steps (means since the
                       last line); the same test/* at step 0, every eval_every steps and at
                       the end (over every held-out pair)
  tensorboard/         the same scalars
  checkpoints/<step>/  params/, opt_state/, run/ every checkpoint.every steps and at the
                       end (pjit_ppo/loop.py): the same command resumes exactly; SIGTERM /
                       SIGINT finish the step, save and exit 0
  model/               the trained policy as an HF directory (config.json +
                       model.safetensors; with LoRA the adapters merged into the float32
                       base) with the tokenizer's files: PPO's
                       model.policy_path, evaluation and export read it
"""
from __future__ import annotations

import os
from typing import Any, Dict

import jax
import jax.numpy as jnp
from absl import logging

from pjit_ppo import loop, optim, param_makers, rng, sharding, supervised
from pjit_ppo.config import ConfigError, DPOConfig
from pjit_ppo.dpo import pairs as pairs_lib, reference
from pjit_ppo.dpo.loss import METRICS, pair_losses
from pjit_ppo.errors import DataError
from pjit_ppo.models import lora

#: The output model directory inside the work directory.
MODEL_DIR = "model"
CONSOLE_KEYS = ("train/loss", "train/rewards/accuracies", "train/rewards/margins",
                "test/loss", "test/rewards/accuracies", "train/lr")


def loss_sums(model_cfg, config: DPOConfig, params, batch, base=None,
              key=None) -> Dict[str, jax.Array]:
    """Sums over a batch of pairs: {"loss", "weight", and every name in METRICS}.

    batch: the pair arrays (`pairs.PAIR_KEYS`, [B, ...]) plus ref_chosen, ref_rejected
    float32 [B] (the reference's summed log-probs); weight float32 [B] (0 for filler
    rows). base: with LoRA the frozen base (params are then the adapters on it); key:
    the adapters' dropout key or None. Returns float32 scalars; the step divides them by
    the weight.
    """
    if base is not None:
        params = lora.attach(base, params, key)
    chosen, rejected = reference.pair_logps(model_cfg, params, batch)
    loss, metrics = pair_losses(chosen, rejected, batch["ref_chosen"], batch["ref_rejected"],
                                beta=config.beta, loss_type=config.loss_type,
                                label_smoothing=config.label_smoothing)
    w = batch["weight"].astype(jnp.float32)
    out = {name: jnp.sum(value * w) for name, value in metrics.items()}
    out.update(loss=jnp.sum(loss * w), weight=jnp.sum(w))
    return out


def _check_sizes(config: DPOConfig, mesh, n_train: int) -> None:
    devices = supervised.batch_devices(mesh)
    micro = config.batch_size // config.gradient_accumulation_steps
    if micro % devices:
        raise ConfigError(f"micro-batch size {micro} (batch_size / gradient_accumulation_steps)"
                          f" is not divisible by the mesh's {devices} batch devices (mesh.data "
                          f"x mesh.fsdp); change batch_size or the mesh")
    if n_train < config.batch_size:
        raise DataError(f"{config.labels_path}: {n_train} training pairs, fewer than "
                        f"batch_size={config.batch_size}; lower batch_size or add labels")


def _reference_source(config: DPOConfig, fingerprints: Dict[str, str]) -> Dict[str, Any]:
    """What the saved reference log-probs were computed from (checked when read back)."""
    model = config.to_dict()["model"]
    model.pop("lora")  # the reference is the model without adapters either way
    return {"reference": "the initial policy", "model": model,
            "seed": config.seed if not config.model.policy_path else None,
            "query_length": config.query_length, "response_length": config.response_length,
            "pad_token_id": config.pad_token_id, "data": fingerprints}


def _precomputed(config, workdir, model_cfg, mesh, initial, arrays, fingerprints, resume,
                 lora_base=None):
    """{split: {"ref_chosen", "ref_rejected"}} of every pair: read back from
    WORKDIR/reference_logps.npz on a resume, else computed from the initial policy
    (its frozen copy is freed afterwards; with LoRA the base, which training keeps)
    and saved. model_cfg: the reference's architecture (without adapters)."""
    path = os.path.join(workdir, reference.REFERENCE_FILE)
    source = _reference_source(config, fingerprints)
    sizes = {split: len(a["weight"]) for split, a in arrays.items()}
    if resume:
        saved = reference.load(path, source, sizes)
        if saved is not None:
            logging.info("DPO: reference log-probs read from %s", path)
            return saved
        logging.warning("DPO: %s is missing or was computed from other data; computing the "
                        "reference log-probs again", path)
    frozen = reference.reference_params(initial, model_cfg.compute_dtype, lora_base=lora_base)
    micro = config.batch_size // config.gradient_accumulation_steps
    out = {split: reference.score_pairs(model_cfg, mesh, frozen, a, micro)
           for split, a in arrays.items()}
    if lora_base is None:
        jax.tree.map(lambda x: x.delete(), frozen)
    reference.save(path, out, source)
    logging.info("DPO: reference log-probs of %s pairs saved to %s",
                 " + ".join(str(n) for n in sizes.values()), path)
    return out


def train(config: DPOConfig, workdir: str) -> Dict[str, Any]:
    """Runs (or resumes) DPO; writes WORKDIR/{config.json, reference_logps.npz,
    metrics.jsonl, tensorboard/, checkpoints/, model/} (module docstring).

    Returns {"train/loss" (mean of the last log window), "test/loss", "test/loss_initial",
    the test/* metrics at the end and "test/rewards/accuracies_initial", "steps",
    "pairs" (training pairs), "model_dir"}; after a SIGTERM / SIGINT only
    {"preempted": True, "steps": steps done} (a checkpoint was saved; the same call
    continues). Raises ConfigError / DataError before any compile for bad values or
    labels (or a resume with another config or labels), and NonFiniteError if the loss
    or gradient stops being finite.
    """
    from pjit_ppo.data import special_ids
    from pjit_ppo.data.prompts import check_tokenizer, load_tokenizer
    from pjit_ppo.loading import copy_tokenizer, lm_config, load_lm, merged_lm, write_config
    from pjit_ppo.models import save_pretrained

    config.validate()
    train_records, test_records = pairs_lib.split_labels(config)
    tokenizer_path = config.tokenizer_path or config.model.policy_path
    tokenizer = load_tokenizer(tokenizer_path)
    vocab_size = lm_config(config.model, config.model.policy_path).vocab_size
    special_ids.resolve_token_ids(config, tokenizer, vocab_size=vocab_size, prefix="",
                                  tokenizer_path=tokenizer_path)
    check_tokenizer(tokenizer, path=tokenizer_path, vocab_size=vocab_size,
                    pad_id=config.pad_token_id, stop_token=config.truncate_token)
    arrays = {"train": pairs_lib.tokenized_pairs(train_records, tokenizer, config),
              "test": pairs_lib.tokenized_pairs(test_records, tokenizer, config)}
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    n_train = len(arrays["train"]["weight"])
    _check_sizes(config, mesh, n_train)
    fingerprints = {"training": loop.fingerprint(arrays["train"]),
                    "held-out": loop.fingerprint(arrays["test"])}
    checkpoints = loop.Checkpoints(workdir, config, fingerprints)
    spec = lora.spec_from_options(config.model.lora)
    base = None  # with LoRA: the frozen base (also the reference); params: the adapters
    if spec is None:
        model_cfg, params = load_lm(config.model, config.model.policy_path, mesh, config.seed)
    else:
        model_cfg, base, params = param_makers.adapted_lm(
            param_makers.Loaded(mesh), config.model, config.model.policy_path, config.seed)
        checkpoints.check_base(lora.fingerprint(base))
    ref_cfg = lora.without_adapters(model_cfg)
    write_config(config, workdir)

    if config.precompute_ref:
        ref_logps = _precomputed(config, workdir, ref_cfg, mesh, params, arrays,
                                 fingerprints, resume=checkpoints.start > 0, lora_base=base)
        arrays = {split: {**a, **ref_logps[split]} for split, a in arrays.items()}
        ref_params = None
    else:
        ref_params = reference.reference_params(params, model_cfg.compute_dtype,
                                                lora_base=base)

    total = config.max_steps or (n_train // config.batch_size) * config.num_epochs
    optimizer = optim.make_optimizer(learning_rate=config.lr, num_updates=total,
                                     anneal_lr=config.anneal_lr, kind=config.optimizer,
                                     eps=config.eps, b1=config.b1, b2=config.b2,
                                     max_grad_norm=config.max_grad_norm)
    opt_state = supervised.init_opt_state(optimizer, params, mesh)

    def loss_fn(p, batch, base=None, key=None):
        sums = loss_sums(model_cfg, config, p, batch, base, key)
        return sums["loss"], sums
    keyed = spec is not None and spec.dropout > 0
    # What the loss and optimizer close over, the token ids read from the tokenizer
    # included (supervised.py: the program cache).
    description = repr(("dpo", config.to_dict(), model_cfg, total))
    train_step = supervised.make_train_step(loss_fn, optimizer, params, opt_state, mesh,
                                            frozen=base, keyed=keyed, description=description)
    eval_step = supervised.make_eval_step(loss_fn, mesh, frozen=base, description=description)
    if ref_params is not None:  # the reference scores each batch (outside the gradient)
        stacked_ref = reference.logps_fn(ref_cfg, mesh, stacked=True)
        flat_ref = reference.logps_fn(ref_cfg, mesh, stacked=False)

        def step_fn(p, o, batch, *key):
            return train_step(p, o, {**batch, **stacked_ref(ref_params, batch)}, *key)

        def eval_fn(p, batch):
            return eval_step(p, {**batch, **flat_ref(ref_params, batch)})
    else:
        step_fn, eval_fn = train_step, eval_step
    micro = config.batch_size // config.gradient_accumulation_steps
    test_arrays = arrays["test"]

    def held_out(params):
        stats = supervised.evaluate(eval_fn, params, mesh, supervised.padded_batches(
            test_arrays, micro, "weight"))
        return {f"test/{name}": stats[name] for name in ("loss",) + METRICS}

    stage = loop.Stage(
        name="DPO", mesh=mesh, step_fn=step_fn, train_arrays=arrays["train"],
        batch_size=config.batch_size, micro_batches=config.gradient_accumulation_steps,
        seed=config.seed, shuffle_tag="dpo", total_steps=total,
        train_metrics=(("train/loss", "loss"), *((f"train/{m}", m) for m in METRICS),
                       ("train/grad_norm", "grad_norm")),
        lr=lambda _, opt_state: float(jax.device_get(optim.current_lr(opt_state))),
        evaluate=held_out, log_every=config.log_every, eval_every=config.eval_every,
        console_keys=CONSOLE_KEYS,
        step_key=(lambda step: rng.stream_key(config.seed, "lora_dropout", step)) if keyed
        else None)
    logging.info("DPO (%s, beta %g): %d training labels -> %d pairs, %d held-out pairs, %d "
                 "steps of %d pairs; reference log-probs %s", config.loss_type, config.beta,
                 len(train_records), n_train, len(test_arrays["weight"]), total,
                 config.batch_size, "precomputed" if config.precompute_ref else "per batch")
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
    logging.info("DPO: held-out loss %.4f -> %.4f, reward accuracy %.3f; model saved to %s",
                 initial["test/loss"], final["test/loss"], final["test/rewards/accuracies"],
                 out_dir)
    result: Dict[str, Any] = dict(final)
    result.update({"train/loss": out.progress.last_train.get("train/loss", float("nan")),
                   "test/loss_initial": initial["test/loss"],
                   "test/rewards/accuracies_initial": initial["test/rewards/accuracies"],
                   "steps": total, "pairs": int(n_train), "model_dir": out_dir})
    return result
