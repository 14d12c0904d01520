"""From a RunConfig to a running PPO job (what the train entry point calls)."""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
from absl import logging

from pjit_ppo import (checkpoint, data, flops, loop, memory_analysis,
                      metrics as metrics_lib, param_makers, rewards, sharding)
from pjit_ppo.config import ConfigError, RunConfig, resume_conflicts
from pjit_ppo.errors import DataError, NonFiniteError
from pjit_ppo.data import special_ids
from pjit_ppo.loading import device_memory_limit, lm_config, write_config
from pjit_ppo.ppo import lora_views, memory_plan
from pjit_ppo.ppo.assembly import assemble
from pjit_ppo.ppo.trainer import PPOTrainer
from pjit_ppo.ppo.types import PromptFn, TrainState
from pjit_ppo.ppo import state_io
from pjit_ppo.sample_table import SampleTable


def load_reward(config: RunConfig, mesh):
    """The run's reward (`pjit_ppo.rewards.build`) as (reward ModelConfig or None, RewardFn,
    frozen reward params or None, fp32 reward trunk + head or None)."""
    reward = rewards.build(config, param_makers.Loaded(mesh))
    return reward.model, reward.fn, reward.params, reward.trunk


class Job(NamedTuple):
    """Everything a PPO run needs, built from a RunConfig.

    prompts_position(iteration) -> JSON-able dict: what the prompt stream needs to
    continue from `iteration` (saved in checkpoints).
    """
    trainer: PPOTrainer
    state: TrainState
    frozen: Dict[str, Any]
    prompts: PromptFn
    num_iterations: int
    prompts_position: Callable[[int], Dict[str, Any]]


def build(config: RunConfig) -> Job:
    """Validates `config` and builds the mesh, the prompts, and the models, trainer and
    state (`pjit_ppo.ppo.assembly`, the assembly the memory planner runs on shapes)."""
    resolve_token_ids(config)
    ppo_cfg = config.ppo
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    # Prompts first: a bad file or tokenizer is reported before any weight is loaded.
    prompts = make_prompts(config, mesh, lm_config(config.model, config.model.policy_path)
                           .vocab_size)
    peak = flops.measure_matmul_peak_flops() * jax.device_count() if config.measure_peak else None
    run = assemble(config, param_makers.Loaded(mesh), peak_flops=peak)
    functions = rewards.host_functions(run.trainer.models.reward_fn)
    if functions:  # the rollout calls them on the host, with the rows' prompt records
        if not hasattr(prompts, "records"):
            raise ConfigError(f"{functions[0].name} scores text: give data.prompts_path "
                              f"(prompts with a tokenizer), not random token prompts")
        run.trainer.host_reward = rewards.HostScorer(
            functions, prompts, samples_per_prompt=ppo_cfg.samples_per_prompt)
    prompts_position = getattr(prompts, "position", None) or functools.partial(
        _synthetic_position, ppo_cfg.seed)

    return Job(run.trainer, run.state, run.frozen, prompts, config.num_updates,
               prompts_position)


def resolve_token_ids(config: RunConfig) -> None:
    """Validates `config` and sets the ids it takes from the tokenizer (ppo.pad_token_id /
    ppo.truncate_token = -1) in place; the launch pre-flight has done so already."""
    config.validate()
    vocab = lm_config(config.model, config.model.policy_path).vocab_size
    special_ids.resolve_from_path(config.ppo, tokenizer_path(config), vocab_size=vocab,
                                  prefix="ppo.")


def tokenizer_path(config: RunConfig) -> str:
    """The run's tokenizer directory: data.tokenizer_path, else the policy's directory."""
    return config.data.tokenizer_path or config.model.policy_path


def make_prompts(config: RunConfig, mesh, vocab_size: int, *, purpose: str = "prompts",
                 seed: Optional[int] = None, batch_size: Optional[int] = None) -> PromptFn:
    """The run's PromptFn: text prompts (data.prompts_path + a tokenizer) or random tokens.

    `purpose`="eval_prompts" reads data.eval_prompts_path when set (held-out prompts).
    """
    ppo_cfg = config.ppo
    seed = ppo_cfg.seed if seed is None else seed
    batch_size = ppo_cfg.prompts_per_iteration if batch_size is None else batch_size
    if not config.data.prompts_path:
        return data.synthetic_prompts(
            mesh, batch_size=batch_size, query_length=ppo_cfg.query_length,
            vocab_size=vocab_size, pad_id=ppo_cfg.pad_token_id, seed=seed,
            min_length=config.data.min_prompt_length, low=config.data.low_token,
            purpose=purpose)
    from pjit_ppo.data import prompts as text  # transformers is imported only for text runs
    options = config.data
    if purpose == "eval_prompts" and options.eval_prompts_path:
        options = dataclasses.replace(options, prompts_path=options.eval_prompts_path)
    return text.text_prompts(mesh, options, batch_size=batch_size,
                             query_length=ppo_cfg.query_length, pad_id=ppo_cfg.pad_token_id,
                             seed=seed, vocab_size=vocab_size,
                             stop_token=ppo_cfg.truncate_token,
                             tokenizer_path=tokenizer_path(config), purpose=purpose)


def _sample_metadata(prompts, iteration: int, rows: int, samples_per_prompt: int
                     ) -> Optional[Dict[str, list]]:
    """The prompt records' metadata of an iteration's first `rows` episodes (the sample
    table's rows), or None when the prompts have none."""
    if not getattr(prompts, "fields", ()):
        return None
    return prompts.records(iteration, range(rows), samples_per_prompt)[1]


def _synthetic_position(seed: int, iteration: int) -> Dict[str, Any]:
    # Synthetic prompts are a pure function of (seed, iteration): the position is all.
    return {"kind": "synthetic", "seed": seed, "next_iteration": iteration}


def frozen_sources(config: RunConfig) -> Dict[str, str]:
    """Where the frozen models come from (recorded in checkpoints instead of their weights)."""
    policy = (config.model.policy_path
              or f"random init (ppo.seed={config.ppo.seed}, model.random)")
    reference = (f"the base of the LoRA adapters (the initial policy): {policy}"
                 if config.model.lora.enabled else f"the initial policy: {policy}")
    return {"reference": reference, "reward": rewards.describe(config)}


def check_bases(saved: Dict[str, Any], now: Dict[str, str], step: int) -> None:
    """Refuses to resume LoRA adapters on other base weights: `now` ({name: fingerprint}
    of the bases, `lora_views.base_fingerprints`) must equal the checkpoint's."""
    was = saved.get("lora_base", {})
    for name, fingerprint in now.items():
        if was.get(name) != fingerprint:
            raise ConfigError(
                f"cannot resume from checkpoint {step}: its LoRA adapters of the {name} were "
                f"trained on base weights with fingerprint {was.get(name)}, these have "
                f"{fingerprint}; point model.policy_path (and reward.path) at the original "
                f"models or start a new --workdir")


def _resume_point(config: RunConfig, checkpointer: checkpoint.RunCheckpointer) -> int:
    """The iteration to continue from (0 = a fresh run); checks the saved config."""
    step = checkpointer.latest_complete(set_aside=True)
    if step is None:
        return 0
    if not config.checkpoint.resume:
        raise ConfigError(f"{checkpointer.directory} holds checkpoint {step} and "
                          f"checkpoint.resume=False: use a new --workdir to start afresh "
                          f"(checkpoints are never overwritten)")
    saved = checkpointer.run_info(step)["config"]
    conflicts = resume_conflicts(saved, config.to_dict())
    if conflicts:
        listed = "; ".join(f"{name}: checkpoint {a!r}, now {b!r}"
                           for name, (a, b) in conflicts.items())
        raise ConfigError(f"cannot resume from checkpoint {step} in {checkpointer.directory}: "
                          f"the config differs in {listed}. Use the checkpoint's values or a "
                          f"new --workdir")
    return step


def _check_prompt_stream(saved: Dict[str, Any], now: Dict[str, Any], step: int) -> None:
    """Refuses to resume on a different prompt set: the data position would mean nothing.
    Changed metadata (the records' other fields) is refused too, when the checkpoint
    recorded its digest."""
    if "metadata_fingerprint" in saved and saved.get("metadata_fingerprint") != now.get(
            "metadata_fingerprint"):
        raise ConfigError(
            f"cannot resume from checkpoint {step}: the prompt records' other fields "
            f"(metadata) changed since it was saved (fingerprint "
            f"{saved.get('metadata_fingerprint')}, now {now.get('metadata_fingerprint')}) in "
            f"{now.get('source') or saved.get('source')}; restore the original prompt file or "
            f"start a new --workdir")
    for key in ("kind", "num_prompts", "fingerprint"):
        if saved.get(key) != now.get(key):
            raise ConfigError(
                f"cannot resume from checkpoint {step}: its prompts were "
                f"{saved.get('source') or saved.get('kind')} ({saved.get('num_prompts')} "
                f"prompts, fingerprint {saved.get('fingerprint')}), now "
                f"{now.get('source') or now.get('kind')} ({now.get('num_prompts')} prompts, "
                f"fingerprint {now.get('fingerprint')}); restore the original prompt file "
                f"or start a new --workdir")


def log_memory_plan(job: Job, state: TrainState) -> Dict[str, Any]:
    """Compiles both phases (the first iteration reuses them: no second compile) and logs
    the memory plan, one line per phase (`pjit_ppo.ppo.memory_plan`); warns when it will
    not fit."""
    cfg = job.trainer.cfg
    shape = (cfg.prompts_per_iteration, cfg.query_length)
    job.trainer.compile(state, job.frozen, jax.ShapeDtypeStruct(shape, jnp.int32),
                        jax.ShapeDtypeStruct(shape, jnp.bool_))
    limit = device_memory_limit()
    plan = memory_plan.trainer_plan(job.trainer, state, job.frozen, limit)
    for phase in memory_plan.PHASES:
        logging.info(memory_analysis.phase_line(phase, plan["phases"][phase], limit))
    if plan["fits"] is False:
        logging.warning("the memory plan's peak (%s) exceeds the device memory (%s): this run "
                        "will run out of memory; see `pjit-ppo-plan` for the breakdown",
                        memory_analysis.gb(plan["peak_bytes"]), memory_analysis.gb(limit))
    return plan


def train(config: RunConfig, workdir: str) -> Dict[str, float]:
    """Runs (or resumes) a PPO job in `workdir`.

    Writes WORKDIR/config.json, metrics.jsonl, tensorboard/ and checkpoints/<iteration>/.
    Running the same command again continues from the latest complete checkpoint:
    metrics.jsonl keeps one line per iteration and the run continues exactly. SIGTERM or
    SIGINT ends the current iteration, saves, and returns normally.

    Returns the last iteration's metrics ({} when there was nothing left to run), with
    "preempted": True added when a signal stopped the run (a checkpoint was saved).
    """
    resolve_token_ids(config)
    checkpointer = checkpoint.RunCheckpointer(workdir, config.checkpoint)
    start = _resume_point(config, checkpointer)
    job = build(config)  # may still refuse the data or the weights: config.json waits for it
    base_fingerprints = lora_views.base_fingerprints(job.trainer.models, job.frozen)
    if start:
        check_bases(checkpointer.run_info(start), base_fingerprints, start)
    write_config(config, workdir)
    state = job.state
    if start:
        _check_prompt_stream(checkpointer.run_info(start).get("prompt_stream", {}),
                             job.prompts_position(start), start)
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                             sharding=x.sharding), state)
        jax.tree.map(lambda x: x.delete(), state)  # free the fresh state before reading
        state = state_io.from_items(checkpointer.restore(start, state_io.to_items(target)))
        logging.info("resuming from checkpoint %d (%s)", start,
                     os.path.join(checkpointer.directory, str(start)))
    dropped = metrics_lib.truncate_jsonl(os.path.join(workdir, "metrics.jsonl"), start)
    if dropped:
        logging.warning("metrics.jsonl: %d line(s) written after iteration %d moved to "
                        "metrics.jsonl.dropped", dropped, start)
    samples_path = os.path.join(workdir, "samples.jsonl")
    metrics_lib.truncate_jsonl(samples_path, start)
    table = None
    if config.data.samples_every:
        job.trainer.sample_every = config.data.samples_every
        job.trainer.sample_rows = min(config.data.samples_per_table,
                                      config.ppo.batch_size)
        table = SampleTable(samples_path, pad_id=config.ppo.pad_token_id,
                            stop_token=config.ppo.truncate_token,
                            truncate_after=config.ppo.truncate_after,
                            tokenizer=getattr(job.prompts, "tokenizer", None))
    log_memory_plan(job, state)
    writer = metrics_lib.make_writers(workdir, job.num_iterations,
                                      tensorboard=config.tensorboard, start_step=start)
    every = config.checkpoint.every
    run_info = {"config": config.to_dict(), "frozen": frozen_sources(config)}
    if base_fingerprints:  # LoRA: the bases the adapters are trained on
        run_info["lora_base"] = base_fingerprints
    last: Dict[str, float] = {}
    saved = {"step": start}

    def save(step, state):
        checkpointer.save(step, state_io.to_items(state),
                          {**run_info, "iteration": step,
                           "prompt_stream": job.prompts_position(step)})
        saved["step"] = step

    def after_iteration(it, state, metrics):
        last.clear()
        last.update(metrics)
        if table is not None and job.trainer.last_samples is not None:
            table.write(it + 1, job.trainer.last_samples, _sample_metadata(
                job.prompts, it, len(job.trainer.last_samples["score"]),
                config.ppo.samples_per_prompt))
        if (it + 1) % every == 0 or it + 1 == job.num_iterations:
            save(it + 1, state)
        final["state"] = state

    final = {"state": state}
    stopping = {"agreed": False}
    profiler = metrics_lib.TraceWindow(config.profile.start, config.profile.iterations,
                                       os.path.join(workdir, "profile"))

    def on_iteration(it, state, metrics):
        profiler.after(it + 1)
        after_iteration(it, state, metrics)

    def should_stop(preemption):
        # Every process stops after the same iteration, even when the signal reached
        # only some of them (a multi-process run then saves one checkpoint together).
        stopping["agreed"] = preemption.agreed()
        return stopping["agreed"]

    try:
        with loop.Preemption() as preemption:
            job.trainer.train(state, job.frozen, job.prompts, job.num_iterations, writer=writer,
                              start_iteration=start, on_iteration=on_iteration,
                              should_stop=lambda: should_stop(preemption),
                              before_iteration=lambda it: profiler.before(it + 1))
            if stopping["agreed"]:
                step = int(final["state"].iteration)
                if saved["step"] != step:
                    save(step, final["state"])
                checkpointer.wait()
                logging.warning("preempted at iteration %d, saved checkpoint %d", step, step)
        checkpointer.wait()
    except (ConfigError, DataError, NonFiniteError):
        # The user's error (e.g. a reward function that raised) or a diverged iteration:
        # the checkpoints already being written (of earlier, finite iterations) are
        # finished, so the latest one stays whole, then the run stops.
        checkpointer.wait()
        raise
    finally:
        profiler.close()
        writer.close()
    return {**last, "preempted": True} if stopping["agreed"] else last
