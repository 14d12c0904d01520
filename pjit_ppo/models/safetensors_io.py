"""Minimal, streaming safetensors reading and writing with numpy (bf16 included).

Why not the `safetensors` package (checked against safetensors 0.8.0)? Not for
bfloat16: its numpy frontend handles it (`safe_open(path, framework="numpy")
.get_slice(name)[...]` returns `ml_dtypes.bfloat16` arrays, equal to ours, and
`safetensors.numpy.save_file` writes BF16). But:

* `safe_open` memory-maps the whole file while the handle is open, and a slice read
  faults in every file page the slice touches (for a column slice of a row-major
  tensor, usually the whole tensor); mapped pages count towards RSS until the
  handle is closed. Measured on one fp32 [100000, 1024] tensor (410 MB file),
  reading [:, :64] (24 MiB): with the handle kept open, RSS grew by 390 MiB of
  file pages that stayed until close; with a handle opened and closed around the
  read, peak RSS (VmHWM) rose by 416 MiB; `CheckpointReader.read` below: peak
  +40 MiB (the slice plus one READ_WINDOW_BYTES window), no file pages kept.
* its writers (`save_file`, `serialize_file`) take every tensor's buffer in one
  call, while export gathers one tensor at a time.

The format is simple (8-byte little-endian header length, a JSON header, then raw
little-endian tensor bytes), so we read and write it directly:

* `CheckpointReader` reads an HF model directory (`model.safetensors` or the
  sharded `model.safetensors.index.json`) and returns *slices* of tensors; a
  read maps the file in windows of at most READ_WINDOW_BYTES, each unmapped
  before the next, so a process holds the slice it asked for and at most one
  window of file pages (page cache pages that stay mapped count towards RSS).
* `write_safetensors` writes one file whose header is planned up front from
  (name, shape, dtype) and whose tensors are produced and written one at a time.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable, Dict, NamedTuple, Sequence, Tuple

import ml_dtypes
import numpy as np

from pjit_ppo.errors import CheckpointError  # noqa: F401 (re-exported by models.hf)

# safetensors data is little-endian; we map it with native dtypes.
if np.little_endian is False:  # pragma: no cover
    raise ImportError("pjit_ppo's safetensors reader needs a little-endian host")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
READ_WINDOW_BYTES = 16 << 20  # file bytes mapped at once by CheckpointReader.read

# safetensors dtype code <-> numpy dtype. Model weights must be floating point.
_CODES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_CODE_OF = {v: k for k, v in _CODES.items()}
WEIGHT_DTYPES = tuple(_CODES)


class TensorInfo(NamedTuple):
    """Where one tensor lives: file, dtype code, shape, absolute byte offset."""
    file: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int


def dtype_code(dtype) -> str:
    """The safetensors code ("F32", "BF16", ...) of a numpy/jax float dtype."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise CheckpointError(f"unsupported dtype {dt} for a safetensors weight; supported: "
                              f"{', '.join(str(d) for d in _CODES.values())}")
    return _CODE_OF[dt]


def read_header(file: str) -> Dict[str, TensorInfo]:
    """Parses a safetensors header: {tensor name: TensorInfo} (no tensor data is read)."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{file}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return {name: TensorInfo(file, h["dtype"], tuple(h["shape"]), 8 + n + h["data_offsets"][0])
            for name, h in header.items()}


class CheckpointReader:
    """Tensor slices from the safetensors files of an HF model directory.

    Args:
      directory: holds `model.safetensors.index.json` (sharded) or `model.safetensors`.

    Raises:
      FileNotFoundError naming the directory and the files expected, when neither
      weights file exists (mentioning PyTorch `.bin` weights if those are there).
    """

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, INDEX_FILE)
        single = os.path.join(directory, SINGLE_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.exists(single):
            files = [SINGLE_FILE]
        else:
            present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            hint = ""
            if any(p.endswith(".bin") or p.endswith(".pt") for p in present):
                hint = (" It holds PyTorch weights; convert them to safetensors first (e.g. "
                        "with transformers: from_pretrained, then save_pretrained).")
            raise FileNotFoundError(
                f"no weights in {directory!r}: expected {SINGLE_FILE!r} or {INDEX_FILE!r} "
                f"(with the model-*-of-*.safetensors files it lists); found {present}.{hint}")
        self.tensors: Dict[str, TensorInfo] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise FileNotFoundError(f"{INDEX_FILE} in {directory!r} lists {name!r}, which "
                                        f"does not exist")
            self.tensors.update(read_header(path))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> Tuple[int, ...]:
        return self.tensors[name].shape

    def read(self, name: str, index: Sequence[slice]) -> np.ndarray:
        """A copy of tensor[index] (basic slices, step 1) in the file's dtype.

        The file is mapped in windows of at most `READ_WINDOW_BYTES` along the first
        dim, each released before the next, so even a column slice (which touches
        every row) keeps at most one window of file pages in this process's RSS.
        """
        info = self.tensors[name]
        if info.dtype not in _CODES:
            raise CheckpointError(f"tensor {name!r} in {info.file} has dtype {info.dtype}; "
                                  f"supported: {', '.join(_CODES)}")
        dtype, shape = _CODES[info.dtype], info.shape
        if not shape:  # a scalar
            return np.memmap(info.file, dtype=dtype, mode="r", offset=info.offset,
                             shape=(1,))[0].copy()
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        bounds = [s.indices(n) for s, n in zip(index, shape)]
        if any(step != 1 for _, _, step in bounds):
            raise ValueError(f"read({name!r}): only step-1 slices are supported, got {index}")
        out = np.empty([max(0, b - a) for a, b, _ in bounds], dtype)
        if out.size == 0:
            return out
        rest = tuple(slice(a, b) for a, b, _ in bounds[1:])
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        rows = max(1, READ_WINDOW_BYTES // row_bytes)
        first, last = bounds[0][0], bounds[0][1]
        for a in range(first, last, rows):
            b = min(a + rows, last)
            mm = np.memmap(info.file, dtype=dtype, mode="r", offset=info.offset + a * row_bytes,
                           shape=(b - a,) + tuple(shape[1:]))
            out[a - first:b - first] = mm[(slice(None),) + rest]
            del mm  # unmaps the window
        return out


def write_safetensors(file: str, specs: Sequence[Tuple[str, Tuple[int, ...], np.dtype]],
                      produce: Callable[[str], np.ndarray],
                      metadata: Dict[str, str] | None = None) -> None:
    """Writes a safetensors file tensor by tensor.

    Args:
      file: output path.
      specs: (name, shape, dtype) of every tensor, in file order.
      produce: called once per name, in order; returns that tensor (converted to
        its dtype here). Only one produced tensor is held at a time.
      metadata: string metadata; {"format": "pt"} is what transformers expects.
    """
    header, offset = {}, 0
    for name, shape, dtype in specs:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": dtype_code(dtype), "shape": [int(s) for s in shape],
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype in specs:
            arr = np.ascontiguousarray(produce(name), dtype=dtype)
            if arr.shape != tuple(shape):
                raise CheckpointError(f"tensor {name!r}: produced shape {arr.shape}, "
                                      f"planned {tuple(shape)}")
            f.write(arr.reshape(-1).view(np.uint8).data)  # no extra copy
            del arr
