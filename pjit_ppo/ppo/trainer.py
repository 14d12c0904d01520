"""PPOTrainer: sharded train state, the two compiled phases, and the iteration loop.

Per iteration: `rollout` (one compiled program) -> `update` (one compiled program,
train state donated) -> metrics to the writers. Both programs are compiled ahead
of time (`compile`, or on the first step) so that compilation is timed on its own
(`time/compile_s`) instead of inflating the first iteration's throughput. The only
host transfers are the prompts going in and the scalar metrics coming out.

A reward with Python functions (`pjit_ppo.rewards.host`) splits the rollout into two
compiled programs (`RolloutPrograms`): sampling, then each process fetches its own rows,
`host_reward` (a `pjit_ppo.rewards.HostScorer`) scores them once per rollout
micro-batch (`time/reward_s`), and the scoring program takes the scores as an input.
Every other reward keeps the single rollout program.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from pjit_ppo import flops as flops_lib
from pjit_ppo import metrics as metrics_lib
from pjit_ppo import distributed, param_makers, program_cache, rng, sharding
from pjit_ppo.config import PPOConfig
from pjit_ppo.errors import NonFiniteError
from pjit_ppo.optim import make_optimizer
from pjit_ppo.ppo.kl import kl_init
from pjit_ppo.ppo.collect import (batch_devices, local_micro_batch_rows, micro_batch_count,
                                  sample)
from pjit_ppo.ppo import lora_views
from pjit_ppo.ppo.rollout import rollout, score_rollout
from pjit_ppo.ppo.types import PPOModels, PromptFn, RolloutBatch, Sampled, TrainState
from pjit_ppo.ppo.update import update


def make_ppo_optimizer(cfg: PPOConfig, num_updates: int) -> optax.GradientTransformation:
    """The optimizer of the reference recipe; the LR anneals over `num_updates` iterations."""
    return make_optimizer(learning_rate=cfg.lr, num_updates=num_updates,
                          anneal_lr=cfg.anneal_lr, kind=cfg.optimizer, eps=cfg.eps,
                          max_grad_norm=cfg.max_grad_norm,
                          steps_per_update=cfg.noptepochs * cfg.nminibatches)


#: The compiled programs of a PPO iteration, in the order they run.
PHASES = ("rollout", "update")


def _check_phases(phases: Sequence[str]) -> Tuple[str, ...]:
    phases = tuple(phases)
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        raise ValueError(f"phases {phases!r}: choose one or more of {PHASES}")
    return phases


def iteration_keys(cfg: PPOConfig, iteration: int) -> Tuple[jax.Array, jax.Array]:
    """(sampling key, update key) of one iteration: own streams, fresh per iteration,
    the same after a resume."""
    return (rng.stream_key(cfg.seed, "sample", iteration),
            rng.stream_key(cfg.seed, "update", iteration))


#: Quantities training depends on, in the order they arise, with the fix that fits each.
GUARDED = (
    ("objective/scores", "the reward is not finite: check the reward model (reward.path) or "
                         "the reward function"),
    ("objective/kl", "the policy's log-probs diverged from the reference: lower ppo.lr or "
                     "set ppo.max_grad_norm"),
    ("ppo/loss/total", "the loss is not finite: lower ppo.lr or set ppo.max_grad_norm"),
    ("ppo/grad_norm", "the gradients are not finite: lower ppo.lr or set ppo.max_grad_norm "
                      "(with bf16 compute, also check for overflow)"),
)


class RolloutPrograms:
    """The two programs of a split rollout (`sample`, then `score`), lowered or compiled.

    `compile()` compiles both; `memory_analysis()` is that of the program with the larger
    per-device peak (argument + output - alias + temp + code): the rollout phase's
    peak, for the memory plan and the planner, which read a phase as one program.
    """

    def __init__(self, sample, score):
        self.sample, self.score = sample, score

    def compile(self) -> "RolloutPrograms":
        return RolloutPrograms(self.sample.compile(), self.score.compile())

    def memory_analysis(self):
        def peak(m):
            return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                    + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
        return max((p.memory_analysis() for p in (self.sample, self.score)), key=peak)


def _compile_all(lowered) -> list:
    """A lowered phase compiled, as a list of programs (two for a split rollout)."""
    compiled = lowered.compile()
    if isinstance(compiled, RolloutPrograms):
        return [compiled.sample, compiled.score]
    return [compiled]


def check_finite(metrics: Dict[str, float], iteration: int) -> None:
    """Raises NonFiniteError naming the first guarded quantity that is not finite.

    iteration: the number of completed iterations (as written to metrics.jsonl).
    Diagnostic metrics (e.g. a variance ratio that is 0/0 when every episode scores
    the same) are not guarded; they are written as null.
    """
    for key, fix in GUARDED:
        if key in metrics and not math.isfinite(metrics[key]):
            raise NonFiniteError(f"{key} = {metrics[key]} at iteration {iteration}: {fix}")


class PPOTrainer:
    """Runs PPO iterations on a mesh.

    Args:
      cfg: PPOConfig (copied: later changes to the caller's object have no effect).
      models: PPOModels (static architectures + reward function).
      mesh: the device mesh; params passed in must already be sharded on it.
      num_updates: the run length in iterations; the learning rate anneals over it.
      optimizer: defaults to `make_ppo_optimizer(cfg, num_updates)`.
      reward_flops: forward FLOPs of scoring one episode with the run's reward
        (`pjit_ppo.rewards.Reward.flops`), only for FLOP accounting.
      peak_flops: device peak FLOP/s (global) for MFU; None leaves MFU out.
    """

    def __init__(self, cfg: PPOConfig, models: PPOModels, mesh: Mesh, *, num_updates: int,
                 optimizer: Optional[optax.GradientTransformation] = None,
                 reward_flops: float = 0.0, peak_flops: Optional[float] = None):
        cfg = copy.deepcopy(cfg).validate()
        if not cfg.uses_critic:
            if models.critic is not None:
                raise ValueError(f"ppo.advantage_estimator={cfg.advantage_estimator!r} trains "
                                 f"no critic: pass models.critic=None")
        elif cfg.shared_trunk != (models.critic is None):
            raise ValueError("ppo.shared_trunk=True needs models.critic=None and vice versa")
        batch_devices = math.prod(mesh.shape[a] for a in sharding.DEFAULT_AXIS_RULES["batch"]
                                  if a in mesh.shape)
        if cfg.prompts_per_iteration % batch_devices:
            raise ValueError(
                f"{cfg.prompts_per_iteration} prompts per iteration (ppo.batch_size // "
                f"ppo.samples_per_prompt) cannot be split evenly over the mesh's "
                f"{batch_devices} batch devices (mesh.data x mesh.fsdp)")
        if cfg.rollout_micro_batch_size % batch_devices:
            raise ValueError(
                f"ppo.rollout_micro_batch_size={cfg.rollout_micro_batch_size} cannot be split "
                f"evenly over the mesh's {batch_devices} batch devices (mesh.data x mesh.fsdp)")
        self.cfg, self.models, self.mesh = cfg, models, mesh
        self.num_updates = int(num_updates)
        self.optimizer = optimizer or make_ppo_optimizer(cfg, self.num_updates)
        #: Whether the default optimizer is rebuilt inside the compiled update from its
        #: run-length argument (`num_updates` an input of the program, so runs differing
        #: only in length share one compile and the compilation cache). The schedule
        #: multiplies by the length's reciprocal, which is what XLA makes of a division by
        #: a constant: the same float32 learning rates as a length compiled in.
        self._run_length_input = optimizer is None
        self.flops = flops_lib.ppo_phase_flops(cfg, models, reward_flops)
        self.peak_flops = peak_flops
        self._programs: Dict[str, Any] = {phase: None for phase in PHASES}
        self.compile_seconds: Optional[float] = None
        self._compile_reported = False
        #: Sample tables: every `sample_every` iterations (and the first) the first
        #: `sample_rows` episodes go to `last_samples` (host numpy; 0 = off).
        self.sample_every, self.sample_rows = 0, 0
        self.last_samples: Optional[Dict[str, np.ndarray]] = None
        self._samples_fn = None
        #: A reward with Python functions: (iteration, rows int [n], response int [n, R],
        #: kept bool [n, R]) -> float32 [n, H] scores of this process's rows (a
        #: `pjit_ppo.rewards.HostScorer`; `pjit_ppo.ppo.run.build` sets it).
        self.host_reward: Optional[Callable] = None
        self.host_columns = models.host_reward_columns
        self._reward_seconds: Optional[float] = None

    # ------------------------------------------------------------ state
    def init_state(self, params, make=None) -> TrainState:
        """TrainState from sharded trainable params; optimizer state sharded like them.

        make: a `pjit_ppo.param_makers` maker; the default makes arrays on the mesh,
        `Abstract(mesh)` (with abstract params) the state's ShapeDtypeStructs.
        """
        make = make or param_makers.Loaded(self.mesh)
        param_sh = jax.tree.map(lambda x: x.sharding, params)
        opt_shapes = jax.eval_shape(self.optimizer.init, params)
        opt_sh = sharding.opt_state_shardings(self.optimizer, param_sh, opt_shapes, self.mesh)
        opt_state = make.compute(self.optimizer.init, opt_sh, params)
        rep = sharding.replicated(self.mesh)
        return TrainState(params, opt_state, make.put(lambda: kl_init(self.cfg), rep),
                          make.put(lambda: jnp.zeros((), jnp.int32), rep))

    # ------------------------------------------------------------ compiled phases
    def compile(self, state: TrainState, frozen, query: jax.Array, query_mask: jax.Array,
                phases: Sequence[str] = PHASES) -> float:
        """Compiles `phases` ("rollout", "update") ahead of time for these shapes and
        shardings; a phase compiled before is kept.

        The arguments may be arrays or jax.ShapeDtypeStructs with shardings (nothing
        is allocated). Returns the seconds it took (added to `compile_seconds`). The
        first `step` compiles what is missing; the first `rollout` compiles the rollout
        alone. `compiled` holds the results.

        With PJIT_PPO_PROGRAM_CACHE_DIR set, a phase stored there by an earlier launch of
        the same programs is loaded instead, without tracing (`pjit_ppo.program_cache`;
        `program_description` says when the trainer can use it).
        """
        t0 = time.perf_counter()
        missing = tuple(p for p in _check_phases(phases) if self._programs[p] is None)
        keys = {p: self._program_key(p, state, frozen, query, query_mask) for p in missing}
        todo = []
        for phase in missing:
            stored = program_cache.load(keys[phase])
            if stored is not None:
                self._programs[phase] = self._phase_program(phase, stored)
            else:
                todo.append(phase)
        if todo:
            lowered = self.lower(state, frozen, query, query_mask, phases=todo)
            for phase in todo:
                programs = program_cache.compile_and_store(
                    keys[phase], functools.partial(_compile_all, lowered[phase]))
                self._programs[phase] = self._phase_program(phase, programs)
        seconds = time.perf_counter() - t0
        self.compile_seconds = (self.compile_seconds or 0.0) + seconds
        # Processes finish compiling at different times; CPU collectives (gloo) give up
        # on a peer more than 30 s late, so all processes start the first step together.
        distributed.barrier("pjit_ppo_compiled")
        return seconds

    def program_description(self) -> Optional[str]:
        """Everything the traced phases close over besides the code and the arguments, as
        a string (`pjit_ppo.program_cache`); None when the trainer cannot describe its
        programs (an optimizer passed in, or a reward function without `program_key`):
        then they are always traced. The run length is left out: the default optimizer
        reads it as an input of the update."""
        reward = getattr(self.models.reward_fn, "program_key", None)
        if not self._run_length_input or reward is None:
            return None
        cfg = tuple((f.name, getattr(self.cfg, f.name)) for f in dataclasses.fields(self.cfg)
                    if f.name != "total_episodes")
        mesh = (tuple(self.mesh.axis_names), tuple(self.mesh.devices.shape),
                tuple(d.id for d in self.mesh.devices.flat))
        return repr((type(self.cfg).__name__, cfg, self.models.policy, self.models.critic,
                     self.models.critic_base, reward, self.host_columns, mesh))

    def _phase_program(self, phase: str, programs: list):
        """A phase's program from its list (`_compile_all`): a split rollout's two as
        RolloutPrograms, else the one."""
        if phase == "rollout" and self.host_columns:
            return RolloutPrograms(*programs)
        (program,) = programs
        return program

    def _program_key(self, phase: str, state, frozen, query, query_mask) -> Optional[str]:
        if program_cache.directory() is None:
            return None
        description = self.program_description()
        if description is None:
            return None
        return program_cache.key(f"ppo/{phase}", description,
                                 (state, frozen, self._prompts(query, query_mask)))

    @property
    def _rollout(self):
        return self._programs["rollout"]

    @property
    def _update(self):
        return self._programs["update"]

    @property
    def compiled(self) -> Optional[Dict[str, jax.stages.Compiled]]:
        """{phase: compiled program} of the phases `compile` compiled so far, else None."""
        done = {p: c for p, c in self._programs.items() if c is not None}
        return done or None

    def lower(self, state: TrainState, frozen, query: jax.Array, query_mask: jax.Array,
              phases: Sequence[str] = PHASES) -> Dict[str, jax.stages.Lowered]:
        """The phases asked for ("rollout", "update"), lowered (not compiled) for these
        shapes and shardings.

        state, frozen: arrays or jax.ShapeDtypeStructs with shardings; query int32
        [P, Q], query_mask bool [P, Q] likewise (P = ppo.prompts_per_iteration).
        Returns {phase: Lowered} for each of `phases`; nothing is allocated.
        """
        phases = _check_phases(phases)
        mesh, cfg = self.mesh, self.cfg
        rep = sharding.replicated(mesh)
        batch_sh = sharding.batch_sharding(mesh, 2)
        state_sh = jax.tree.map(lambda x: x.sharding, state)

        def constrain_batch(mb):
            return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, batch_sh), mb)

        # Every field is [B, ...] rank 2 except the [B] scores (the last field).
        batch_out = RolloutBatch(*[batch_sh] * (len(RolloutBatch._fields) - 1),
                                 scores=sharding.batch_sharding(mesh, 1))
        key = self._key(jax.random.PRNGKey(0))
        query, query_mask = self._prompts(query, query_mask)
        if self.host_columns:  # sampling, the host's functions, scoring: two programs
            models = self.models

            def sample_phase(policy, query, query_mask, key, base):
                return sample(cfg, models, lora_views.policy_view(models, policy, base), query,
                              query_mask, key, mesh=mesh)
            sample_phase.__name__ = "sample"
            sample_jit = jax.jit(sample_phase, out_shardings=Sampled(batch_sh, batch_sh,
                                                                     batch_sh))
            rollout_jit = jax.jit(functools.partial(score_rollout, cfg, self.models, mesh=mesh),
                                  out_shardings=(batch_out, rep))
            sample_args = (state.params["policy"], query, query_mask, key,
                           self._policy_base(frozen))
            sampled = jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=batch_sh),
                jax.eval_shape(sample_jit, *sample_args))
            host = jax.ShapeDtypeStruct((cfg.batch_size, self.host_columns), jnp.float32,
                                        sharding=batch_sh)
            rollout_args = (state.params, frozen, state.kl_coef, query, query_mask, sampled,
                            host)
            out = {} if "rollout" not in phases else {"rollout": RolloutPrograms(
                sample_jit.lower(*sample_args), rollout_jit.lower(*rollout_args))}
        else:
            rollout_jit = jax.jit(functools.partial(rollout, cfg, self.models, mesh=mesh),
                                  out_shardings=(batch_out, rep))
            rollout_args = (state.params, frozen, state.kl_coef, query, query_mask, key)
            out = {} if "rollout" not in phases else {"rollout": rollout_jit.lower(*rollout_args)}
        if "update" not in phases:
            return out

        def update_phase(state, batch, kl, key, num_updates, bases):
            # The LR schedule's length comes in as an int32 scalar: runs that differ only
            # in their length share one compiled update (and the compilation cache).
            optimizer = (make_ppo_optimizer(cfg, num_updates) if self._run_length_input
                         else self.optimizer)
            return update(cfg, self.models, optimizer, state, batch, kl, key,
                          batch_constraint=constrain_batch, frozen=bases)
        update_phase.__name__ = "update"
        update_jit = jax.jit(update_phase, donate_argnums=(0,), out_shardings=(state_sh, rep))
        batch_shapes, _ = jax.eval_shape(rollout_jit, *rollout_args)
        batch_abstract = jax.tree.map(  # the update does not read the scores
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=batch_sh),
            batch_shapes._replace(scores=None))
        kl_abstract = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
        length_abstract = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
        out["update"] = update_jit.lower(state, batch_abstract, kl_abstract, key,
                                         length_abstract,
                                         lora_views.update_frozen(self.models, frozen))
        return out

    def _policy_base(self, frozen):
        """The frozen base of LoRA policy adapters (frozen["ref"]), else None."""
        return frozen["ref"] if lora_views.uses_adapters(self.models) else None

    def _key(self, key: jax.Array) -> jax.Array:
        return jax.device_put(key, sharding.replicated(self.mesh))

    def _prompts(self, query, query_mask):
        """The prompts in the batch sharding the compiled program expects (a no-op when
        they already are, as the data pipeline makes them). Abstract prompts
        (jax.ShapeDtypeStruct) get the sharding only."""
        batch_sh = sharding.batch_sharding(self.mesh, 2)
        if isinstance(query, jax.ShapeDtypeStruct):
            return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sh)
                         for x in (query, query_mask))
        return jax.device_put(query, batch_sh), jax.device_put(query_mask, batch_sh)

    def rollout(self, state: TrainState, frozen, query, query_mask, iteration: int):
        """The rollout phase alone (compiled): (RolloutBatch, metrics on device). The first
        call compiles the rollout (not the update) unless `compile` did."""
        if self._rollout is None:
            self.compile(state, frozen, query, query_mask, phases=("rollout",))
        sample_key, _ = iteration_keys(self.cfg, iteration)
        query, query_mask = self._prompts(query, query_mask)
        if not self.host_columns:
            return self._rollout(state.params, frozen, state.kl_coef, query, query_mask,
                                 self._key(sample_key))
        sampled = self._rollout.sample(state.params["policy"], query, query_mask,
                                       self._key(sample_key), self._policy_base(frozen))
        jax.block_until_ready(sampled)
        t0 = time.perf_counter()
        host = self._host_scores(iteration, sampled)
        self._reward_seconds = time.perf_counter() - t0
        return self._rollout.score(state.params, frozen, state.kl_coef, query, query_mask,
                                   sampled, host)

    def _host_scores(self, iteration: int, sampled: Sampled) -> jax.Array:
        """The host functions' scores float32 [B, H], batch-sharded: each process fetches
        the rows its devices hold, and `host_reward` scores them once per rollout
        micro-batch (in the batch's row order); nothing crosses processes."""
        if self.host_reward is None:
            raise ValueError("the reward has Python functions that run on the host: set "
                             "trainer.host_reward (a pjit_ppo.rewards.HostScorer; "
                             "pjit_ppo.ppo.run.build does)")
        cfg = self.cfg
        rows, (response, kept) = _local_rows(sampled.response, sampled.kept)
        scores = np.zeros((cfg.batch_size, self.host_columns), np.float32)
        chunk = local_micro_batch_rows(cfg, rows, batch_devices(self.mesh))
        for c in range(micro_batch_count(cfg)):
            sel = chunk == c
            if sel.any():
                scores[rows[sel]] = self.host_reward(iteration, rows[sel], response[sel],
                                                     kept[sel])
        return jax.make_array_from_callback(scores.shape, sharding.batch_sharding(self.mesh, 2),
                                            lambda index: scores[index])

    def step(self, state: TrainState, frozen, query: jax.Array, query_mask: jax.Array,
             iteration: int) -> Tuple[TrainState, Dict[str, float]]:
        """One PPO iteration. `state` is donated; returns the new state and host metrics.

        The first call compiles the phases not compiled yet (by `compile` or a first
        `rollout`); the first step after a compile adds `time/compile_s`.
        """
        if self._rollout is None or self._update is None:
            self.compile(state, frozen, query, query_mask)
        _, update_key = iteration_keys(self.cfg, iteration)
        t0 = time.perf_counter()
        batch, rollout_metrics = self.rollout(state, frozen, query, query_mask, iteration)
        jax.block_until_ready(batch)
        t1 = time.perf_counter()
        state, update_metrics = self._update(state, batch._replace(scores=None),
                                             rollout_metrics["objective/kl"],
                                             self._key(update_key),
                                             jax.device_put(np.int32(self.num_updates),
                                                            sharding.replicated(self.mesh)),
                                             lora_views.update_frozen(self.models, frozen))
        jax.block_until_ready(state.params)
        t2 = time.perf_counter()
        due = self.sample_every and (iteration == 0 or (iteration + 1) % self.sample_every == 0)
        self.last_samples = self._take_samples(batch) if due else None  # outside the timings
        metrics = {k: float(v) for k, v in jax.device_get({**rollout_metrics,
                                                           **update_metrics}).items()}
        metrics.update(self._throughput(t1 - t0, t2 - t1))
        if self.host_columns:
            metrics["time/reward_s"] = self._reward_seconds
        if not self._compile_reported:  # the first step after the compile
            metrics["time/compile_s"] = self.compile_seconds
            self._compile_reported = True
        metrics.update(metrics_lib.device_memory_stats())
        metrics["ppo/episode"] = float((iteration + 1) * self.cfg.batch_size)
        return state, metrics

    def _take_samples(self, batch: RolloutBatch) -> Dict[str, np.ndarray]:
        """The first `sample_rows` episodes of a batch on every host (a small replicated
        gather, so it works when the batch spans several processes)."""
        if self._samples_fn is None:
            n = self.sample_rows
            self._samples_fn = jax.jit(
                lambda b: {"query": b.query[:n], "query_mask": b.query_mask[:n],
                           "response": b.response[:n], "score": b.scores[:n]},
                out_shardings=sharding.replicated(self.mesh))
        return {k: np.asarray(v) for k, v in self._samples_fn(batch).items()}

    def _throughput(self, rollout_s: float, update_s: float) -> Dict[str, float]:
        cfg = self.cfg
        tokens = cfg.batch_size * (cfg.query_length + cfg.response_length)
        out = {"time/rollout_s": rollout_s, "time/update_s": update_s,
               "time/iteration_s": rollout_s + update_s}
        for phase, secs in (("rollout", rollout_s), ("update", update_s)):
            out[f"throughput/{phase}_episodes_per_s"] = cfg.batch_size / secs
            out[f"throughput/{phase}_tokens_per_s"] = tokens / secs
            out[f"throughput/{phase}_tflops"] = self.flops[phase] / secs / 1e12
            if self.peak_flops:
                out[f"throughput/{phase}_mfu"] = flops_lib.mfu(self.flops[phase], secs,
                                                               self.peak_flops)
        out["throughput/episodes_per_s"] = cfg.batch_size / (rollout_s + update_s)
        return out

    def train(self, state: TrainState, frozen, prompts: PromptFn,
              num_iterations: Optional[int] = None, writer=None, start_iteration: int = 0,
              on_iteration: Optional[Callable[[int, TrainState, Dict[str, float]], None]] = None,
              should_stop: Optional[Callable[[], bool]] = None,
              before_iteration: Optional[Callable[[int], None]] = None) -> TrainState:
        """Runs iterations start_iteration .. num_iterations - 1; returns the final state.

        num_iterations defaults to the trainer's num_updates. After each iteration the
        metrics are written, `on_iteration(it, state, metrics)` runs (e.g. a checkpoint
        save), and the loop ends early when `should_stop()` is true (e.g. preemption).
        `before_iteration(it)` runs before each iteration's prompts (e.g. a profiler).
        Stops with NonFiniteError (after writing that iteration's metrics) when a
        guarded quantity is not finite.
        """
        num_iterations = self.num_updates if num_iterations is None else num_iterations
        for it in range(start_iteration, num_iterations):
            if before_iteration is not None:
                before_iteration(it)
            query, query_mask = prompts(it)
            state, metrics = self.step(state, frozen, query, query_mask, it)
            if writer is not None:
                writer.write(it + 1, metrics)  # iterations completed
            check_finite(metrics, it + 1)
            if on_iteration is not None:
                on_iteration(it, state, metrics)
            if should_stop is not None and should_stop():
                break
        return state


def _local_rows(*arrays: jax.Array):
    """(rows int64 [n], numpy copies [n, ...] of each array): the batch rows this process's
    devices hold of batch-sharded [B, ...] arrays, ascending (a row replicated over the
    tensor axis is taken once)."""
    pieces = {}
    for shard in arrays[0].addressable_shards:
        lo, hi, _ = shard.index[0].indices(arrays[0].shape[0])
        pieces.setdefault(lo, hi)
    starts = sorted(pieces)
    rows = np.concatenate([np.arange(lo, pieces[lo]) for lo in starts]).astype(np.int64)
    out = []
    for x in arrays:
        by_start = {}
        for shard in x.addressable_shards:
            lo = shard.index[0].indices(x.shape[0])[0]
            if lo not in by_start:
                by_start[lo] = np.asarray(shard.data)
        out.append(np.concatenate([by_start[lo] for lo in starts]))
    return rows, tuple(out)
