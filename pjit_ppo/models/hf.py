"""HF safetensors checkpoints <-> our Haiku parameters, streamed and sharded.

Import (`load_pretrained`): every parameter is created shard by shard
(`make_array_shard_by_shard`, a leaner `jax.make_array_from_callback`). The
callback for a device reads only that device's slice of the HF tensor(s), per
layer for stacked parameters, and applies the family's re-indexing
(`families.layout.TensorMap`: transpose, head reshape, fused-QKV split). Besides the
parameters themselves, a host holds at most one shard and one bounded file
window at a time; never a whole tensor, let alone the whole model.

Export (`save_pretrained`): writes `config.json` and safetensors files in the
HF layout and names, so `transformers.AutoModelForCausalLM.from_pretrained`
loads them. Tensors are gathered to the host one HF tensor (one layer) at a
time and written straight into their file.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import haiku as hk
import jax
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from pjit_ppo import sharding as sharding_lib
from pjit_ppo.models import families, transformer
from pjit_ppo.models.config import ModelConfig
from pjit_ppo.models.families.layout import TensorMap
from pjit_ppo.models.safetensors_io import (INDEX_FILE, SINGLE_FILE, WEIGHT_DTYPES,
                                            CheckpointError, CheckpointReader, dtype_code,
                                            write_safetensors)

__all__ = ["load_pretrained", "save_pretrained", "CheckpointError"]

_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


# ================================================================== import
def load_pretrained(path: str, *, mesh: Optional[Mesh] = None, dtype: str = "float32",
                    param_rules: Sequence = sharding_lib.DEFAULT_PARAM_RULES,
                    axis_rules: Mapping[str, Any] = sharding_lib.DEFAULT_AXIS_RULES,
                    config_overrides: Optional[Mapping[str, Any]] = None
                    ) -> Tuple[ModelConfig, hk.Params]:
    """Loads an HF checkpoint directory into sharded Haiku parameters.

    Args:
      path: directory with `config.json` and `model.safetensors` or
        `model.safetensors.index.json` (+ the shards it lists); or a llama.cpp
        `.gguf` file (`pjit_ppo.models.gguf`: Llama models, tensors dequantized to
        float32 slice by slice, then converted to `dtype`).
      mesh: device mesh to shard onto (by `param_rules` / `axis_rules`); None puts
        every parameter on the first device.
      dtype: storage dtype of the parameters: "float32" (trainable models),
        "bfloat16" or "float16" (frozen ones). Converted slice by slice.
      param_rules, axis_rules: partition rules (see `pjit_ppo.sharding`).
      config_overrides: ModelConfig fields to override (e.g. compute_dtype).

    Returns:
      (config, params): params is the tree of `transformer.param_shapes(config)`,
      each leaf a jax.Array of `dtype` with its NamedSharding (or single-device).

    Raises:
      FileNotFoundError: no such directory (or GGUF file), no config.json, no weights.
      ModelConfigError: unsupported architecture.
      CheckpointError: a tensor is missing, has the wrong shape or dtype.
    """
    if not str(path).lower().endswith(".gguf"):  # GGUF files are checked by their reader
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no HF model directory at {path!r} (expected config.json "
                                    f"and {SINGLE_FILE} or {INDEX_FILE})")
        if not os.path.exists(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"no config.json in {path!r}: an HF model directory needs "
                                    f"config.json and {SINGLE_FILE} or {INDEX_FILE}")
    try:
        dtype = jax.numpy.dtype(dtype).name
    except TypeError:
        dtype = str(dtype)
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {_SUPPORTED_DTYPES}, got {dtype!r}")
    config = ModelConfig.from_pretrained(path, **dict(config_overrides or {}))
    reader = checkpoint_reader(path)
    maps = families.get(config.architecture).tensor_maps(config)
    shapes = transformer.param_shapes(config)
    names = _resolve_names(config, reader, maps, shapes)
    if mesh is None:
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, shapes)
    else:
        shardings = sharding_lib.param_shardings(shapes, mesh, param_rules, axis_rules)

    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    params = {}
    for module, leaves in shapes.items():
        params[module] = {}
        for pname, leaf in leaves.items():
            m = maps[(module, pname)]
            params[module][pname] = make_array_shard_by_shard(
                leaf.shape, shardings[module][pname],
                _slice_reader(reader, m, names[(module, pname)], leaf.shape, np_dtype))
    return config, params


def checkpoint_reader(path: str):
    """The tensor reader of a model: `CheckpointReader` for an HF directory, or
    `gguf.GGUFCheckpoint` (the same interface, HF names) for a `.gguf` file."""
    if str(path).lower().endswith(".gguf"):
        from pjit_ppo.models.gguf import GGUFCheckpoint  # the gguf package, only when needed
        return GGUFCheckpoint(path)
    return CheckpointReader(path)


def make_array_shard_by_shard(shape, sharding, callback) -> jax.Array:
    """`jax.make_array_from_callback`, but holding one shard on the host at a time.

    make_array_from_callback first calls the callback for every addressable
    device and only then transfers, so the host briefly holds this process's whole
    part of the array (for a stacked [n_layers, ...] weight of a 6B model on one
    8-GPU host: the whole weight, several GB). Here each distinct shard is read,
    put on its device(s) and dropped before the next is read. Same callback
    contract: `callback(index)` returns the numpy slice `array[index]`.
    """
    device_indices = sharding.addressable_devices_indices_map(shape)
    groups: Dict[tuple, Tuple[tuple, list]] = {}  # replicas of one shard are read once
    for device, index in device_indices.items():
        key = tuple(s.indices(n) for s, n in zip(index, shape))
        groups.setdefault(key, (index, []))[1].append(device)
    arrays = {}
    for index, devices in groups.values():
        data = callback(index)
        for device in devices:
            arrays[device] = jax.device_put(data, device)
            arrays[device].block_until_ready()  # transfer done before the next read
        del data
    return jax.make_array_from_single_device_arrays(shape, sharding,
                                                    [arrays[d] for d in device_indices])


def _resolve_names(config, reader, maps, shapes) -> Dict[Tuple[str, str], List[str]]:
    """Checks every tensor exists with the expected shape; returns the names found,
    per parameter (one per layer for stacked parameters)."""
    missing_in_maps = [f"{m}/{n}" for m, leaves in shapes.items() for n in leaves
                       if (m, n) not in maps]
    if missing_in_maps:  # a bug in the family's tensor maps, not a user error
        raise RuntimeError(f"no HF mapping for parameters {missing_in_maps}")
    family = families.get(config.architecture)
    out = {}
    for (module, pname), m in maps.items():
        layers = range(config.n_layers) if m.layered else [None]
        found = []
        for layer in layers:
            want = m.name(layer)
            name = next((n for n in family.candidate_names(want) if n in reader), None)
            if name is None:
                raise CheckpointError(
                    f"tensor {want!r} (for {module}/{pname}) is missing from the checkpoint in "
                    f"{reader.directory!r}; does config.json match the weights?")
            if reader.shape(name) != m.hf_shape:
                raise CheckpointError(
                    f"tensor {name!r} in {reader.directory!r} has shape {reader.shape(name)} but "
                    f"config.json implies {m.hf_shape} (for {module}/{pname}); the config and "
                    f"the weights do not match")
            code = reader.tensors[name].dtype
            if code not in WEIGHT_DTYPES:
                raise CheckpointError(
                    f"tensor {name!r} in {reader.directory!r} has unsupported dtype {code}; "
                    f"supported: {', '.join(WEIGHT_DTYPES)}")
            found.append(name)
        out[(module, pname)] = found
    return out


def _slice_reader(reader: CheckpointReader, m: TensorMap, names: List[str], shape,
                  dtype: np.dtype):
    """The per-shard callback of one parameter: index (slices) -> numpy `dtype` slice."""

    def callback(index: Tuple[slice, ...]) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if not m.layered:
            return read_slice(reader, m, names[0], index, dtype)
        layers = range(*index[0].indices(shape[0]))
        sub_shape = [len(range(*s.indices(n))) for s, n in zip(index[1:], shape[1:])]
        out = np.empty([len(layers)] + sub_shape, dtype)
        for j, layer in enumerate(layers):
            out[j] = read_slice(reader, m, names[layer], index[1:], dtype)
        return out

    return callback


def read_slice(reader: CheckpointReader, m: TensorMap, name: str, index: Sequence[slice],
               dtype) -> np.ndarray:
    """Our (per-layer) array's [index] read from HF tensor `name` laid out as `m`.

    index: one basic slice per dim of `m.our_shape`. Reads the bounding box of the
    needed elements in each HF dim (exactly the slice when it is contiguous, as for
    every default sharding except NeoX's interleaved q/k/v rows under tensor
    parallelism), then re-indexes. Returns `dtype` [*slice shape].
    """
    sizes = m.sub_sizes
    ranges: List[Optional[np.ndarray]] = [None] * len(sizes)
    for our_dim, sub in enumerate(m.ours):
        ranges[sub] = np.arange(*index[our_dim].indices(sizes[sub]))
    for sub, value in m.select:
        ranges[sub] = np.array([value])
    hf_index, takes, pos = [], [], 0
    for group in m.split:
        flat = np.zeros(1, np.int64)
        for r, n in zip(ranges[pos:pos + len(group)], group):
            flat = (flat[:, None] * n + r[None, :]).reshape(-1)
        pos += len(group)
        lo, hi = int(flat[0]), int(flat[-1]) + 1  # flat is increasing
        hf_index.append(slice(lo, hi))
        takes.append(None if hi - lo == flat.size else flat - lo)
    block = reader.read(name, hf_index)
    for axis, take in enumerate(takes):
        if take is not None:
            block = np.take(block, take, axis=axis)
    block = block.reshape([len(r) for r in ranges])
    block = block.transpose(list(m.ours) + [sub for sub, _ in m.select])
    block = block.reshape(block.shape[:len(m.ours)])
    return np.asarray(block, dtype=dtype)


# ================================================================== export
def save_pretrained(path: str, config: ModelConfig, params: hk.Params, *,
                    max_shard_size: Union[int, str] = "5GB",
                    dtype: Optional[str] = None) -> List[str]:
    """Writes an HF checkpoint (config.json + safetensors) that transformers can load.

    Args:
      path: output directory (created). Weight files of an earlier export there
        (`model.safetensors`, `model-*-of-*.safetensors`, the index) are replaced.
      config: the model's ModelConfig (its imported config.json is reused).
      params: our parameter tree (sharded jax.Arrays, or numpy arrays).
      max_shard_size: bytes per safetensors file, an int or "500MB" / "2GiB"; one
        file (`model.safetensors`) when everything fits, else
        `model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json`.
      dtype: dtype to write ("float32", "bfloat16", "float16"); default: each
        parameter's own dtype.

    Returns:
      The weight file names written (on every process).

    In a multi-process run every process must call this (all take part in
    gathering each tensor); only process 0 writes.
    """
    maps = families.get(config.architecture).tensor_maps(config)
    _check_tree(config, params, maps)
    out_dtype = None if dtype is None else np.dtype(jax.numpy.dtype(dtype))
    plan = _export_plan(config, params, maps, out_dtype)
    shards = _shard(plan, _parse_size(max_shard_size))
    n = len(shards)
    files = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors"
                                          for k in range(n)]
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(path, exist_ok=True)
    for file, shard in zip(files, shards):
        specs = [(name, shape, dt) for name, shape, dt, _ in shard]
        sources = {name: src for name, _, _, src in shard}
        produce = lambda name: _assemble(params, sources[name])  # noqa: E731
        if writer:
            write_safetensors(os.path.join(path, file), specs, produce, {"format": "pt"})
        else:
            for name, *_ in specs:  # take part in the collective gathers
                produce(name)
    if writer:
        _write_index_and_config(path, config, plan, shards, files)
    return files


def _check_tree(config, params, maps):
    have = {(m, n) for m, leaves in params.items() for n in leaves}
    if have != set(maps):
        extra, missing = sorted(have - set(maps)), sorted(set(maps) - have)
        raise ValueError(f"params do not match a {config.architecture} model of this config: "
                         f"missing {missing}, unexpected {extra}")
    for (module, pname), m in maps.items():
        shape = tuple(params[module][pname].shape)
        want = ((config.n_layers,) if m.layered else ()) + m.our_shape
        if shape != want:
            raise ValueError(f"{module}/{pname} has shape {shape}, expected {want}")


def _export_plan(config, params, maps, out_dtype):
    """[(hf name, hf shape, dtype, [(module, pname, TensorMap, layer)])] in HF order."""
    by_name: Dict[str, list] = {}
    for (module, pname), m in maps.items():
        for layer in (range(config.n_layers) if m.layered else [None]):
            by_name.setdefault(m.name(layer), []).append((module, pname, m, layer))
    plan = []
    for name, sources in by_name.items():
        m0 = sources[0][2]
        chosen = {tuple(m.select) for _, _, m, _ in sources}
        if len(chosen) != len(sources) or (m0.select and len(sources) != _n_selected(m0)):
            raise RuntimeError(f"tensor maps do not cover fused tensor {name!r}")  # a bug
        dt = out_dtype or np.dtype(params[sources[0][0]][sources[0][1]].dtype)
        dtype_code(dt)  # unsupported dtypes fail here, on every process, before writing
        plan.append((name, m0.hf_shape, dt, sources))
    return sorted(plan, key=lambda p: _natural_key(p[0]))


def _n_selected(m: TensorMap) -> int:
    n = 1
    for sub, _ in m.select:
        n *= m.sub_sizes[sub]
    return n


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _parse_size(size: Union[int, str]) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", str(size), re.IGNORECASE)
    if not match:
        raise ValueError(f"max_shard_size {size!r}: use bytes (int) or e.g. '500MB', '2GiB'")
    unit = match.group(2).upper()
    base = 1024 if "I" in unit else 1000
    return int(float(match.group(1)) * base ** " KMGT".index(unit[0] if unit != "B" else " "))


def _shard(plan, max_bytes: int):
    """Greedy split of the plan into files of at most max_bytes (a bigger tensor alone)."""
    shards, current, size = [], [], 0
    for entry in plan:
        nbytes = int(np.prod(entry[1])) * entry[2].itemsize
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    return shards + [current] if current else shards or [[]]


def _assemble(params, sources) -> np.ndarray:
    """One HF tensor from the (per-layer slices of the) parameter(s) stored in it."""
    m0 = sources[0][2]
    out = None
    for module, pname, m, layer in sources:
        part = fetch(params[module][pname], layer)
        if out is None:
            out = np.empty(m.sub_sizes, part.dtype)
        where = [slice(None)] * len(m.sub_sizes)
        for sub, value in m.select:
            where[sub] = value
        # Indexing fixes the selected sub-dims; the rest are in increasing order.
        out[tuple(where)] = part.transpose(np.argsort(m.ours))
    return out.reshape(m0.hf_shape)


def fetch(x, layer: Optional[int] = None) -> np.ndarray:
    """Host copy of x (or x[layer]), gathered from its shards.

    Single-process arrays are assembled from the addressable shards (slicing the
    layer on each device first); arrays spanning processes are gathered with a
    collective, so every process must call this in the same order.
    """
    if not isinstance(x, jax.Array):
        x = np.asarray(x)
        return x if layer is None else x[layer]
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        if layer is not None:
            x = _take_layer(x, layer)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    if layer is None:
        return np.asarray(x)
    out = np.empty(x.shape[1:], x.dtype)
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        start, stop, _ = shard.index[0].indices(x.shape[0])
        if start <= layer < stop:
            out[shard.index[1:]] = np.asarray(shard.data[layer - start])
    return out


@jax.jit
def _take_layer(x, layer):
    return jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)


def _write_index_and_config(path, config, plan, shards, files):
    """config.json (+ dtype, architectures), the index if sharded; removes stale weights."""
    hf = config.to_hf_dict()
    hf.setdefault("model_type", config.architecture)
    if not hf.get("architectures"):
        hf["architectures"] = [families.get(config.architecture).hf_class]
    saved = {str(dt) for _, _, dt, _ in plan}
    if len(saved) == 1:
        hf["dtype"] = saved.pop()
        hf.pop("torch_dtype", None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    ours = re.compile(r"model(-\d+-of-\d+)?\.safetensors|" + re.escape(INDEX_FILE))
    stale = [n for n in os.listdir(path) if ours.fullmatch(n) and n not in files]
    if len(files) > 1:
        weight_map = {name: file for file, shard in zip(files, shards) for name, *_ in shard}
        total = sum(int(np.prod(shape)) * dt.itemsize for _, shape, dt, _ in plan)
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        stale = [n for n in stale if n != INDEX_FILE]
    for name in stale:
        os.remove(os.path.join(path, name))
