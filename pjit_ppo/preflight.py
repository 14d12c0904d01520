"""Pre-flight checks: everything about a launch that can be wrong, found before anything heavy.

An entry point calls these after parsing its flags and before it builds a mesh, loads a
weight or compiles a program, so a bad launch ends within seconds with one line naming
the field, the value and the fix (`ConfigError`; the CLI prints it and exits 2), and
leaves the work directory as it was.

Two stages, because asking jax for its devices must wait until a multi-process run has
joined its peers (`pjit_ppo.cli.common.setup_jax`):

* `check_train(config, workdir)` / `check_evaluate` / `check_export`: no devices needed.
  The config's own checks (`RunConfig.validate`: types, NaN, ranges, batch arithmetic
  within the config), every path it names (model and reward directories with their
  config.json and safetensors headers, tokenizer, prompt files), whether the work
  directory can be written, and the model's shape against the config (context length,
  token ids inside the vocabulary, the remat policy, and what the reward kind asks:
  `pjit_ppo.rewards`, e.g. the reward model's vocabulary), and every Python reward
  function (imported and called once on the first prompt records with empty
  responses: `check_reward_functions`). Returns the `RunModels` it read, for the
  second stage.
* `check_sft(config, workdir)` / `check_reward_learning` / `check_dpo`: the stages
  before PPO, the same way (config values, work directory, model and tokenizer
  directories, reward learning's query + response against the context), then every corpus or
  label record (`DataError` naming the file and line; the CLI prints it as one line and
  exits 2). They need no devices and start nothing.
* `check_devices(config, models, device_count)`: the weights' tensor names, shapes and
  dtypes against the models (safetensors headers), the mesh against the devices (the
  product of its axes, each sharded parameter dimension divisible by its mesh axes under
  the partition rules of `pjit_ppo.sharding`) and the batch against the batch devices.

Nothing here writes a file or allocates a device buffer. Reading a model's shape costs
one small JSON file (model.policy_path/config.json, reward.path/config.json) or nothing
(model.random); the safetensors headers are read, not the tensors.
"""
from __future__ import annotations

import json
import math
import os
from typing import NamedTuple, Optional, Tuple

from pjit_ppo import rewards
from pjit_ppo.config import ConfigError, RunConfig

__all__ = ["RunModels", "check_train", "check_reward_functions", "check_evaluate",
           "check_export", "check_sft",
           "check_reward_learning", "check_dpo", "check_plan", "check_devices", "check_weights", "check_workdir",
           "check_model_dir", "check_readable", "model_config"]


class RunModels(NamedTuple):
    """The shapes of a run's models (`pjit_ppo.models.ModelConfig`), read from config.json
    files or model.random.

    reward: the first model the reward kind runs (`RewardKind.models`), None when it
      runs none (e.g. reward.kind="target_tokens").
    reward_models: (config field, path, ModelConfig) of every model the reward runs.
    """
    policy: object
    reward: Optional[object]
    reward_models: Tuple[Tuple[str, str, object], ...] = ()


def _fail(message: str) -> None:
    raise ConfigError(message)


# ------------------------------------------------------------------------- paths
def check_readable(field: str, path: str, *, directory: Optional[bool] = None,
                   what: str = "") -> None:
    """`path` exists, has the expected kind (directory or file) and can be read.

    Args:
      field: the config field or flag that names it ("data.prompts_path").
      directory: True: must be a directory; False: a file; None: either.
      what: what the path should hold, for the fix ("an HF model directory").
    """
    hint = f"; point it at {what}" if what else ""
    if not os.path.exists(path):
        _fail(f"{field}={path!r}: no such file or directory{hint}")
    if directory is True and not os.path.isdir(path):
        _fail(f"{field}={path!r} is a file, not a directory{hint}")
    if directory is False and os.path.isdir(path):
        _fail(f"{field}={path!r} is a directory, not a file{hint}")
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
    except OSError as e:
        _fail(f"{field}={path!r} cannot be read ({e.strerror}); fix its permissions or copy "
              f"it somewhere readable")


def check_model_dir(field: str, path: str) -> dict:
    """An HF model directory: config.json that parses, and safetensors weights (their
    headers are checked by `check_weights`); or a llama.cpp .gguf file whose metadata
    reads. Returns the HF config.json dict."""
    what = ("a local HF model directory (config.json + model.safetensors or its index) or a "
            ".gguf file")
    if path.lower().endswith(".gguf"):
        return _gguf_config(field, path, what)
    check_readable(field, path, directory=True, what=what)
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        _fail(f"{field}={path!r} has no config.json; point it at {what}")
    try:
        with open(config_file) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        _fail(f"{field}={path!r}: config.json cannot be read as JSON ({e}); re-download or "
              f"re-export the model")
    if not isinstance(hf, dict):
        _fail(f"{field}={path!r}: config.json holds {type(hf).__name__}, not an object")
    names = ("model.safetensors", "model.safetensors.index.json")
    if not any(os.path.isfile(os.path.join(path, name)) for name in names):
        bin_hint = (" (it holds PyTorch weights: convert them to safetensors, e.g. with "
                    "transformers' from_pretrained then save_pretrained)"
                    if any(n.endswith((".bin", ".pt")) for n in os.listdir(path)) else "")
        _fail(f"{field}={path!r} has no weights: expected {names[0]} or {names[1]}"
              f"{bin_hint}; point it at {what}")
    return hf


def _gguf_config(field: str, path: str, what: str) -> dict:
    """The HF config dict of a .gguf file's metadata (one line naming the field if not)."""
    check_readable(field, path, directory=False, what=what)
    from pjit_ppo.errors import CheckpointError
    from pjit_ppo.models import gguf
    from pjit_ppo.models.families import ModelConfigError
    try:
        return gguf.read_hf_config(path)
    except (ModelConfigError, CheckpointError, OSError, ValueError) as e:
        _fail(f"{field}={path!r}: {_first_line(e)}")


def check_workdir(workdir: str, field: str = "--workdir", *, must_exist: bool = False) -> None:
    """The work directory can be written (created if absent), without writing anything.

    An existing directory must be writable, and so must its config.json and
    metrics.jsonl; an absent one needs its nearest existing parent to be a writable
    directory. Read-only file systems count as not writable (even for root).
    """
    if not workdir:
        _fail(f"{field} is empty; give the directory the run writes to")
    path = os.path.abspath(workdir)
    if os.path.exists(path) and not os.path.isdir(path):
        _fail(f"{field}={workdir!r} is a file; give a directory (it is created if absent)")
    if must_exist and not os.path.isdir(path):
        _fail(f"{field}={workdir!r}: no such directory; give the work directory of a run "
              f"(the --workdir it was trained with)")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        _fail(f"{field}={workdir!r} cannot be created: {existing!r} is a file; choose "
              f"another directory")
    if not _writable(existing):
        _fail(f"{field}={workdir!r} cannot be written ({existing!r} is not writable or on a "
              f"read-only file system); choose a directory you can write")
    for name in ("config.json", "metrics.jsonl"):
        file = os.path.join(path, name)
        if os.path.exists(file) and not _writable(file):
            _fail(f"{field}={workdir!r}: {name} there is not writable; fix its permissions or "
                  f"use a new --workdir")


def _writable(path: str) -> bool:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return False
    except OSError:
        return False
    return os.access(path, os.W_OK | (os.X_OK if os.path.isdir(path) else 0))


# ------------------------------------------------------------------------- models
def _hf_config(config: RunConfig, field: str, path: str) -> dict:
    """The HF config.json dict of one model: `path`'s (checking the directory) or
    model.random's."""
    if path:
        return check_model_dir(field, path)
    if not config.model.random:
        _fail(f"{field} is empty and model.random is empty: point {field} at an HF model "
              f"directory or give model.random an HF config.json dict")
    return dict(config.model.random)


def model_config(config: RunConfig, field: str, path: str, hf: Optional[dict] = None):
    """The ModelConfig the run builds for one model: from `path`'s config.json when set
    (checking the directory), else from model.random. `field` names the path's config
    field in messages; `hf` is the config.json dict when already read."""
    from pjit_ppo.models.config import ModelConfig
    from pjit_ppo.models.families import ModelConfigError
    hf = _hf_config(config, field, path) if hf is None else hf
    source = f"{field}={path!r}" if path else "model.random"
    try:
        return ModelConfig.from_hf_dict(hf, **config.model.overrides())
    except KeyError as e:
        _fail(f"{source}: the HF config lacks the key {e}; give the full config.json of the "
              f"architecture")
    except (ModelConfigError, TypeError, ValueError) as e:
        _fail(f"{source}: {e}")


def _check_data_paths(config: RunConfig) -> None:
    data = config.data
    if not data.prompts_path:
        return
    check_readable("data.prompts_path", data.prompts_path,
                   what="a JSONL or text file of prompts, or a saved HF dataset directory")
    if getattr(data, "eval_prompts_path", ""):
        check_readable("data.eval_prompts_path", data.eval_prompts_path,
                       what="a JSONL or text file of prompts, or a saved HF dataset directory")
    if data.tokenizer_path:
        check_readable("data.tokenizer_path", data.tokenizer_path,
                       directory=None if _is_gguf(data.tokenizer_path) else True,
                       what="an HF tokenizer directory (tokenizer.json or vocab files) or "
                            "a .gguf file")
    elif not config.model.policy_path:
        _fail(f"data.prompts_path={data.prompts_path!r} needs a tokenizer, and "
              f"data.tokenizer_path and model.policy_path are empty: set data.tokenizer_path "
              f"to an HF tokenizer directory")


def check_model_fit(config: RunConfig, models: RunModels) -> None:
    """The config against the models' shapes: context length, token ids, remat policy."""
    ppo = config.ppo
    length = ppo.query_length + ppo.response_length
    for name, model in (("policy", models.policy),
                        *(("reward model", m) for _, _, m in models.reward_models)):
        if length > model.max_positions:
            _fail(f"ppo.query_length={ppo.query_length} + ppo.response_length="
                  f"{ppo.response_length} = {length} tokens exceed the {name}'s context of "
                  f"{model.max_positions} positions; shorten the query or the response")
    vocab = models.policy.vocab_size
    if ppo.truncate_token is not None and not 0 <= ppo.truncate_token < vocab:
        _fail(f"ppo.truncate_token={ppo.truncate_token} is not a token of the policy's "
              f"vocabulary of {vocab}; give a token id in [0, {vocab}) or None")
    rewards.get(config.reward.kind).check_fit(
        config, models.policy, tuple(m for _, _, m in models.reward_models))
    if not config.data.prompts_path and config.data.low_token >= vocab:
        _fail(f"data.low_token={config.data.low_token} >= the policy's vocabulary size {vocab}: "
              f"random prompts would have no token to draw; lower it")
    policy = config.model.remat_policy
    if policy not in ("none", "full"):
        import jax
        if not hasattr(jax.checkpoint_policies, policy):
            _fail(f"model.remat_policy={policy!r}; use 'none', 'full' or a name in "
                  f"jax.checkpoint_policies (e.g. 'dots_saveable')")


def _check_config(config: RunConfig, *, data: bool = True) -> RunModels:
    if not isinstance(config, RunConfig):
        _fail(f"the recipe's get_config() returned {type(config).__name__}, not a RunConfig")
    config.validate()
    if data:
        _check_data_paths(config)
    paths = [("model.policy_path", config.model.policy_path),
             *rewards.get(config.reward.kind).models(config)]
    # Files first (no jax import yet), then the shapes.
    dicts = [_hf_config(config, field, path) for field, path in paths]
    shapes = [model_config(config, field, path, hf) for (field, path), hf in zip(paths, dicts)]
    reward_models = tuple((field, path, shape)
                          for (field, path), shape in zip(paths[1:], shapes[1:]))
    models = RunModels(shapes[0], shapes[1] if len(shapes) > 1 else None, reward_models)
    _resolve_token_ids(config.ppo, config.data.tokenizer_path or config.model.policy_path,
                       models.policy.vocab_size, "ppo.")
    check_model_fit(config, models)
    return models


def _resolve_token_ids(sequences, tokenizer_path: str, vocab_size: int, prefix: str) -> None:
    """Ids the config takes from the tokenizer (-1), set in place before they are checked,
    so the run and its config.json see the ids themselves."""
    from pjit_ppo.data import special_ids
    from pjit_ppo.errors import DataError
    try:
        special_ids.resolve_from_path(sequences, tokenizer_path, vocab_size=vocab_size,
                                      prefix=prefix)
    except DataError as e:
        _fail(str(e))


def check_train(config: RunConfig, workdir: str) -> RunModels:
    """Everything a training launch can get wrong without asking for devices.

    Raises ConfigError (one line: field, value, fix). Returns the models' shapes.
    """
    check_workdir(workdir)
    models = _check_config(config)
    check_reward_functions(config)
    return models


def check_reward_functions(config: RunConfig) -> None:
    """Every Python reward function of the run (`pjit_ppo.rewards.function_specs(config)`) is
    imported and called once on a dry batch: the first prompt records (with their
    metadata) and empty responses. A SPEC that does not import, a signature that does
    not fit, an exception, a wrong number of scores, a non-number or a non-finite score
    is a RewardFunctionError (a ConfigError: one line, exit 2) before anything heavy.
    A prompts file that cannot be read is left to the build (it names file and line)."""
    specs = rewards.function_specs(config)
    if not specs or not config.data.prompts_path:
        return
    from pjit_ppo.data import prompts as prompt_data
    from pjit_ppo.errors import DataError
    from pjit_ppo.rewards.host import DRY_RUN_ROWS, HostFunction
    try:
        texts, metadata = prompt_data.load_prompt_records(
            config.data.prompts_path, config.data.prompts_format, config.data.prompt_field)
    except DataError:
        texts, metadata = [], []
    rows = min(DRY_RUN_ROWS, len(texts))
    for field, spec in specs:
        function = HostFunction(spec, field)
        function.load()
        if rows:
            function.dry_run(texts[:rows], metadata[:rows])


def check_plan(config: RunConfig) -> RunModels:
    """A planner launch (`pjit-ppo-plan`): the config and every model it names (their
    config.json gives the shapes it plans); prompts are not read, so not checked."""
    return _check_config(config, data=False)


def check_evaluate(config: RunConfig, workdir: str) -> RunModels:
    """An evaluation launch: the config and its paths, and a run directory to read."""
    check_workdir(workdir, must_exist=True)
    return _check_config(config)


def check_export(workdir: str, output: str) -> None:
    """An export launch: an existing run directory, and an output directory to write."""
    check_workdir(workdir, must_exist=True)
    check_workdir(output, "--output")


# ------------------------------------------------------------------------- other stages
def _check_stage_config(config, cls_name: str, script: str) -> None:
    """`config` is the stage's config class (named, to import no stage) and validates."""
    from pjit_ppo import config as config_lib
    cls = getattr(config_lib, cls_name)
    if not isinstance(config, cls):
        _fail(f"the recipe's get_config() returned {type(config).__name__}; {script} needs a "
              f"{cls_name} (pjit_ppo/config/)")
    config.validate()


def _check_stage_model(config, field: str, path: str, length: Optional[int] = None,
                       what: str = "") -> None:
    """An HF model directory (or model.random when `path` is ""): readable, its shape
    buildable, and (when given) `length` tokens within its context."""
    shape = model_config(config, field, path)
    if length is not None and length > shape.max_positions:
        source = f"{field}={path!r}" if path else "model.random"
        _fail(f"{what} of {length} tokens exceed the context of {shape.max_positions} "
              f"positions of {source}; shorten them or use a model with a longer context")


def _is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


def _check_tokenizer_dir(config) -> None:
    if config.tokenizer_path:
        check_readable("tokenizer_path", config.tokenizer_path,
                       directory=None if _is_gguf(config.tokenizer_path) else True,
                       what="an HF tokenizer directory (tokenizer.json or vocab files) or "
                            "a .gguf file")


def check_sft(config, workdir: Optional[str] = None) -> None:
    """An SFT launch (`pjit-ppo-sft`): the SFTConfig's values, the work directory, the
    model and tokenizer directories, and every corpus record (DataError naming file and
    line). No devices needed."""
    _check_stage_config(config, "SFTConfig", "train_sft")
    if workdir is not None:
        check_workdir(workdir)
    _check_tokenizer_dir(config)
    _check_stage_model(config, "model.policy_path", config.model.policy_path)
    from pjit_ppo.data import corpus
    fields = dict(fmt=config.data_format, text_field=config.text_field,
                  prompt_field=config.prompt_field, completion_field=config.completion_field)
    corpus.load_documents(config.data_path, **fields)
    if config.eval_path:
        corpus.load_documents(config.eval_path, **fields)


def check_reward_learning(config, workdir: Optional[str] = None) -> None:
    """A reward-learning launch (`pjit-ppo-reward`): the RewardLearningConfig's values, the
    work directory, the policy and reward-trunk directories, query + response against
    their context (as PPO's pre-flight will check them on the same fields), the
    tokenizer and normalisation prompts, and every label record (DataError naming file
    and line). No devices needed."""
    _check_stage_config(config, "RewardLearningConfig", "train_reward")
    if workdir is not None:
        check_workdir(workdir)
    _check_tokenizer_dir(config)
    length = config.query_length + config.response_length
    what = "query_length + response_length"
    _check_stage_model(config, "model.policy_path", config.model.policy_path, length, what)
    if config.init_path:
        _check_stage_model(config, "init_path", config.init_path, length, what)
    if config.norm_prompts_path:
        check_readable("norm_prompts_path", config.norm_prompts_path,
                       what="a JSONL or text file of prompts, or a saved HF dataset directory")
    from pjit_ppo.data import preferences
    preferences.load_preferences(config.labels_path)
    if config.test_labels_path:
        preferences.load_preferences(config.test_labels_path)


def check_dpo(config, workdir: Optional[str] = None) -> None:
    """A DPO launch (`pjit-ppo-dpo`): the DPOConfig's values, the work directory, the
    policy (and reference) directory, query + response against its context, the
    tokenizer, and every label record (DataError naming file and line). No devices
    needed."""
    _check_stage_config(config, "DPOConfig", "train_dpo")
    if workdir is not None:
        check_workdir(workdir)
    _check_tokenizer_dir(config)
    _check_stage_model(config, "model.policy_path", config.model.policy_path,
                       config.query_length + config.response_length,
                       "query_length + response_length")
    from pjit_ppo.data import preferences
    preferences.load_preferences(config.labels_path)
    if config.test_labels_path:
        preferences.load_preferences(config.test_labels_path)


# ------------------------------------------------------------------------- devices
def mesh_sizes(config: RunConfig, device_count: int) -> dict:
    """{"data", "fsdp", "tensor"} sizes with -1 resolved; ConfigError if they do not
    multiply to `device_count`."""
    sizes = {"data": config.mesh.data, "fsdp": config.mesh.fsdp, "tensor": config.mesh.tensor}
    shown = " ".join(f"mesh.{k}={v}" for k, v in sizes.items())
    known = math.prod(v for v in sizes.values() if v != -1)
    free = [k for k, v in sizes.items() if v == -1]
    if free:
        if device_count % known:
            _fail(f"{shown}: {device_count} devices are not divisible by the fixed axes "
                  f"(product {known}), so mesh.{free[0]}=-1 has no size; make the fixed axes "
                  f"divide {device_count}")
        sizes[free[0]] = device_count // known
    elif known != device_count:
        _fail(f"{shown} multiply to {known} devices but {device_count} are available; make "
              f"the product {device_count}, or set one axis to -1 (= the remaining devices)")
    return sizes


def check_weights(config: RunConfig, models: RunModels) -> None:
    """Every tensor the models need is in their safetensors (or GGUF) files with the shape
    and a dtype config.json implies (headers only; nothing is read or allocated)."""
    from pjit_ppo.models import families, hf, param_shapes
    from pjit_ppo.errors import CheckpointError
    for field, path, model in (("model.policy_path", config.model.policy_path, models.policy),
                               *models.reward_models):
        if not path:
            continue
        try:
            hf._resolve_names(model, hf.checkpoint_reader(path),  # noqa: SLF001 (same check)
                              families.get(model.architecture).tensor_maps(model),
                              param_shapes(model))
        except (OSError, ValueError, CheckpointError) as e:
            _fail(f"{field}={path!r}: {_first_line(e)}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_devices(config: RunConfig, models: RunModels, device_count: Optional[int] = None,
                  *, evaluation: bool = False) -> dict:
    """What needs jax's runtime: the weights' tensors against the models' shapes, the mesh
    against the devices and the models, and the batch against the mesh.

    Args:
      device_count: the global device count (default `jax.device_count()`; call this
        after a multi-process run has initialised).
      evaluation: also check evaluation.num_prompts against the batch devices.
    Returns the resolved mesh sizes {"data", "fsdp", "tensor"}. Raises ConfigError.
    """
    import jax
    from jax.sharding import AbstractMesh

    from pjit_ppo import sharding
    from pjit_ppo.models import param_shapes
    if device_count is None:
        device_count = jax.device_count()
    check_weights(config, models)
    sizes = mesh_sizes(config, device_count)
    mesh = AbstractMesh(tuple(sizes[a] for a in sharding.MESH_AXES), sharding.MESH_AXES)
    shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
    for name, model in (("policy", models.policy),
                        *(("reward model", m) for _, _, m in models.reward_models)):
        try:
            sharding.param_specs(param_shapes(model), mesh)
        except sharding.ShardingError as e:
            _fail(f"mesh ({shown}) does not fit the {name}: {e}")
    batch_axes = sharding.DEFAULT_AXIS_RULES["batch"]
    devices = math.prod(sizes[a] for a in batch_axes)
    axes = " x ".join(f"mesh.{a}" for a in batch_axes)
    ppo = config.ppo
    if ppo.prompts_per_iteration % devices:
        _fail(f"ppo.batch_size={ppo.batch_size} / ppo.samples_per_prompt="
              f"{ppo.samples_per_prompt} = {ppo.prompts_per_iteration} prompts per iteration "
              f"cannot be split over the {devices} batch devices ({axes}); make it a multiple "
              f"of {devices}")
    split = ppo.nminibatches * ppo.gradient_accumulation_steps * devices
    if ppo.batch_size % split:
        _fail(f"ppo.batch_size={ppo.batch_size} is not divisible by ppo.nminibatches="
              f"{ppo.nminibatches} x ppo.gradient_accumulation_steps="
              f"{ppo.gradient_accumulation_steps} x {devices} batch devices ({axes}) = {split}; "
              f"make the batch a multiple of {split} or lower those factors")
    if evaluation and config.evaluation.num_prompts % devices:
        _fail(f"evaluation.num_prompts={config.evaluation.num_prompts} cannot be split over "
              f"the {devices} batch devices ({axes}); make it a multiple of {devices}")
    micro = getattr(ppo, "rollout_micro_batch_size", 0)
    if micro and micro % devices:
        _fail(f"ppo.rollout_micro_batch_size={micro} cannot be split over the {devices} batch "
              f"devices ({axes}); make it a multiple of {devices}")
    return sizes
