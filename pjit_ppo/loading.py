"""Loading what every stage starts from, owned by none: a language model (an HF
directory, or random init from a config dict; with LoRA adapters merged in), its
tokenizer's files, a run's config.json, and how much memory one device has.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
from typing import List, Optional

import jax

from pjit_ppo import program_cache, sharding
from pjit_ppo.config import ModelOptions
from pjit_ppo.models import ModelConfig, init_params, load_pretrained, lora, param_shapes

#: The files of an HF tokenizer directory that are copied next to a stage's output model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model",
                   "vocab.txt", "spiece.model", "chat_template.jinja")

def load_lm(options: ModelOptions, path: str, mesh, seed: int):
    """(ModelConfig, fp32 params sharded on mesh) from an HF dir, or random from options.random."""
    overrides = options.overrides()
    if path:
        return load_pretrained(path, mesh=mesh, dtype="float32", config_overrides=overrides)
    config = ModelConfig.from_hf_dict(dict(options.random), **overrides)
    return config, random_params(config, mesh, seed)


def random_params(config: ModelConfig, mesh, seed: int):
    """`init_params(config, PRNGKey(seed))` (fp32), each parameter created already in its
    sharding on `mesh` by the default partition rules. The init program is described by
    the config and those shardings, so a launch with the program cache on
    (`pjit_ppo.program_cache`) loads it instead of tracing the model."""
    shapes = param_shapes(config)
    shardings = sharding.param_shardings(shapes, mesh)
    key = jax.random.PRNGKey(seed)
    init = jax.jit(functools.partial(init_params, config), out_shardings=shardings)
    outputs = jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                  sharding=where),
                           shapes, shardings)
    program = program_cache.compiled("models/init_params",
                                     repr((config, program_cache.arguments(outputs))),
                                     init, key)
    return program(key)


def merged_lm(options: ModelOptions, path: str, mesh, seed: int, spec, adapters):
    """(ModelConfig, fp32 params) of `load_lm` with LoRA adapters merged in: each adapted
    weight becomes W + alpha / rank * A @ B in float32 (`lora.merge`), an ordinary model
    (what SFT and DPO save and `pjit-ppo-export` writes for a run with adapters). The
    base is read (or drawn) again in float32, so the merge keeps its full precision."""
    config, params = load_lm(options, path, mesh, seed)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    merged = jax.jit(functools.partial(lora.merge, spec), out_shardings=shardings,
                     donate_argnums=0)(params, adapters)
    return config, merged


def lm_config(options: ModelOptions, path: str) -> ModelConfig:
    """The ModelConfig load_lm would build (read from config.json; no weights)."""
    if path:
        return ModelConfig.from_pretrained(path, **options.overrides())
    return ModelConfig.from_hf_dict(dict(options.random), **options.overrides())


def write_config(config, workdir: str) -> str:
    """Writes WORKDIR/config.json atomically (a temp file renamed over it); returns the path.

    `config`: a RunConfig, or any stage config with `to_dict()` (SFT, reward learning).

    Process 0 only (the others return the path without writing)."""
    path = os.path.join(workdir, "config.json")
    if jax.process_index() != 0:
        return path
    os.makedirs(workdir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(config.to_dict(), f, indent=2, default=str)
    os.replace(tmp, path)
    return path


def copy_tokenizer(tokenizer_path: str, out_dir: str) -> List[str]:
    """Copies the tokenizer files of `tokenizer_path` (an HF directory) into `out_dir`, or
    writes the HF tokenizer of a .gguf file there; returns the file names written."""
    copied = []
    if jax.process_index() != 0:  # one writer (the directory may be shared)
        return copied
    if tokenizer_path.lower().endswith(".gguf"):
        from pjit_ppo.models import gguf
        return list(gguf.save_tokenizer(tokenizer_path, out_dir))
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_path, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, name))
            copied.append(name)
    return copied


def device_memory_limit() -> Optional[int]:
    """Bytes one device may allocate, where the backend says (None on CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # backends differ: some raise instead of returning None
        stats = {}
    return int(stats["bytes_limit"]) if "bytes_limit" in stats else None
