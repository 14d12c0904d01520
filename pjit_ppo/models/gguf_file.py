"""One GGUF file (llama.cpp's format): its metadata, and rows of its tensors as float32.

The `gguf` package parses the header (`gguf.GGUFReader` maps the file but touches only
the header's pages) and dequantizes (`gguf.quants.dequantize`). Tensor bytes are read
here in windows of at most READ_WINDOW_BYTES of float32 output, each mapping released
before the next, so a read holds the rows it asked for and one window, never a whole
tensor (as `safetensors_io.CheckpointReader` does for safetensors).

Layout: GGUF lists a tensor's dims fastest first (ggml `ne`); `GGUFTensor.shape` is in
numpy / torch order, so a torch Linear weight [out, in] is [out, in] here, and its
quantization blocks run along each row (`in`).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Dict, NamedTuple, Optional, Tuple

import gguf
import numpy as np

from pjit_ppo.errors import CheckpointError

__all__ = ["GGUFFile", "GGUFTensor", "open_file", "READ_WINDOW_BYTES", "TESTED_TYPES"]

READ_WINDOW_BYTES = 16 << 20  # float32 bytes dequantized per window by GGUFFile.read_rows
#: GGML tensor types the tests cover; any other type the gguf package dequantizes is read too.
TESTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


class GGUFTensor(NamedTuple):
    """Where one tensor lives in the file.

    ggml_type: "F32", "Q4_K", ...; shape: numpy order (rows are the last dim);
    offset: absolute byte offset of its data; row_bytes: bytes of one (quantized) row.
    """
    name: str
    ggml_type: str
    shape: Tuple[int, ...]
    offset: int
    row_bytes: int


class GGUFFile:
    """The header of a GGUF file, and its tensors' rows on demand.

    Args:
      path: a `.gguf` file (little-endian; GGUF versions 2 and 3).

    Raises:
      FileNotFoundError: no such file.
      CheckpointError: not a GGUF file, a big-endian one, or a tensor of a type the gguf
        package cannot dequantize.
    """

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no GGUF file at {path!r}")
        self.path = path
        try:
            reader = gguf.GGUFReader(path)
        except (ValueError, OSError, IndexError, KeyError, TypeError) as e:  # a damaged file
            raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
        if reader.byte_order != "I":
            raise CheckpointError(f"{path}: a big-endian GGUF file; convert it to little-endian "
                                  f"(gguf's gguf_convert_endian script)")
        self._fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        self.tensors: Dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            kind = t.tensor_type.name
            if not _can_dequantize(t.tensor_type):
                raise CheckpointError(f"{path}: tensor {t.name!r} has GGML type {kind}, which the "
                                      f"gguf package cannot dequantize")
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            rows = int(np.prod(shape[:-1], dtype=np.int64))
            self.tensors[t.name] = GGUFTensor(t.name, kind, shape, int(t.data_offset),
                                              int(t.n_bytes) // max(rows, 1))

    def keys(self):
        """The metadata keys (without the header's GGUF.* entries)."""
        return self._fields.keys()

    def value(self, key: str, default: Any = None) -> Any:
        """Metadata `key` as a Python value (int, float, bool, str, or a list), else default.

        A float32 scalar becomes the shortest decimal that rounds to it (1e-05, not
        9.999999747378752e-06: the value the converter was given)."""
        field = self._fields.get(key)
        if field is None:
            return default
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            return float(str(np.float32(field.contents())))
        return field.contents()

    def array_length(self, key: str) -> Optional[int]:
        """The length of array `key` without decoding it (None when absent)."""
        field = self._fields.get(key)
        return None if field is None else len(field.data)

    def read_rows(self, name: str, rows: np.ndarray, cols: slice = slice(None)) -> np.ndarray:
        """float32 [len(rows), len(cols)]: rows `rows` (of the tensor as [-1, row length]),
        dequantized whole (blocks span the row), then `cols` of each."""
        t = self.tensors[name]
        width = t.shape[-1] if t.shape else 1
        rows = np.asarray(rows, np.int64).reshape(-1)
        n_cols = len(range(*cols.indices(width)))
        out = np.empty((rows.size, n_cols), np.float32)
        qtype = gguf.GGMLQuantizationType[t.ggml_type]
        window = max(1, READ_WINDOW_BYTES // (4 * width))
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        i = 0
        while i < ordered.size:
            first = int(ordered[i])
            j = int(np.searchsorted(ordered, first + window, "left"))
            span = int(ordered[j - 1]) + 1 - first
            mm = np.memmap(self.path, np.uint8, "r", offset=t.offset + first * t.row_bytes,
                           shape=(span, t.row_bytes))
            raw = mm[ordered[i:j] - first]  # a copy of the rows wanted (fancy indexing)
            del mm  # unmaps the window
            out[order[i:j]] = gguf.quants.dequantize(raw, qtype).reshape(j - i, width)[:, cols]
            i = j
        return out


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> GGUFFile:
    del mtime_ns, size  # the cache key: a rewritten file is parsed again
    return GGUFFile(path)


def open_file(path: str) -> GGUFFile:
    """`GGUFFile(path)`, parsed once per file version (parsing a 50k-token vocabulary's
    header takes a second or two, and a launch reads the config several times)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}")
    real = os.path.realpath(path)
    stat = os.stat(real)
    return _open(real, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=None)
def _can_dequantize(qtype: gguf.GGMLQuantizationType) -> bool:
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True
