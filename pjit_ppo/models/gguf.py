"""GGUF files (llama.cpp) as pretrained models: the config from metadata, tensors by HF name.

`read_hf_config(path)` turns a Llama GGUF's `llama.*` / `tokenizer.ggml.*` metadata into
the HF config.json dict of the same model, so `ModelConfig.from_pretrained` and export
treat the file like an HF directory. `GGUFCheckpoint(path)` offers the interface
`hf.load_pretrained` reads tensors through (`CheckpointReader`'s: HF names and shapes,
`read(name, slices)`), so the sharded, slice-by-slice import is the same code: names
map to llama.cpp's, quantized rows are dequantized to float32 as they are read, and the
Q / K projection rows are put back in HF's order (llama.cpp's converter interleaves
the two rotary halves of each head). The tokenizer: `gguf_tokenizer` (re-exported).
"""
from __future__ import annotations

import re
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from pjit_ppo.errors import CheckpointError
from pjit_ppo.models.families.config_json import ModelConfigError
from pjit_ppo.models.gguf_file import TESTED_TYPES, GGUFFile, open_file
from pjit_ppo.models.gguf_tokenizer import load_tokenizer, save_tokenizer

__all__ = ["is_gguf", "read_hf_config", "GGUFCheckpoint", "load_tokenizer", "save_tokenizer",
           "TESTED_TYPES"]

SUPPORTED_ARCHITECTURES = ("llama",)
# HF Llama tensor names <-> llama.cpp's.
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf(path: str) -> bool:
    """Whether `path` names a GGUF file (by its `.gguf` suffix) rather than an HF directory."""
    return str(path).lower().endswith(".gguf")


# ------------------------------------------------------------------ config
def read_hf_config(path: str) -> Dict[str, Any]:
    """The HF Llama config.json dict of a GGUF file, from its metadata and tensor list.

    Sizes from `llama.*` (embedding_length, block_count, feed_forward_length,
    attention.head_count[_kv], attention.key_length, context_length,
    attention.layer_norm_rms_epsilon, rope.freq_base), the vocabulary size from the
    token embedding's rows, tied embeddings when there is no `output.weight`, biases
    when the layers have them, special ids from `tokenizer.ggml.*`.

    Raises:
      FileNotFoundError / CheckpointError: no such file, or not a readable GGUF.
      ModelConfigError: not a Llama model, or one this decoder cannot represent (mixture
        of experts, scaled or partial rotary embeddings).
    """
    return _hf_config(open_file(path))


def _hf_config(f: GGUFFile) -> Dict[str, Any]:
    arch = f.value("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(f"{f.path}: GGUF architecture {arch!r} is not supported; "
                               f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def get(key, default=KeyError):
        value = f.value(f"{arch}.{key}", None)
        if value is None:
            if default is KeyError:
                raise ModelConfigError(f"{f.path}: no {arch}.{key} in the GGUF metadata")
            return default
        if isinstance(value, list):  # per-layer values: one value for every layer only
            if len(set(value)) != 1:
                raise ModelConfigError(f"{f.path}: {arch}.{key} differs between layers "
                                       f"({value}); not supported")
            value = value[0]
        return value

    if get("expert_count", 0):
        raise ModelConfigError(f"{f.path}: a mixture-of-experts model ({arch}.expert_count="
                               f"{get('expert_count')}); not supported")
    scaling = f.value(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in f.tensors:
        raise ModelConfigError(f"{f.path}: scaled rotary embeddings (rope scaling "
                               f"{scaling!r}, or rope_freqs.weight) are not supported")
    if "token_embd.weight" not in f.tensors:
        raise CheckpointError(f"{f.path}: no token_embd.weight tensor")
    d, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", d // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelConfigError(f"{f.path}: rotary on {get('rope.dimension_count')} of "
                               f"{head_dim} head dims (partial rotary) is not supported")
    theta = float(get("rope.freq_base", 10000.0))
    hf = dict(model_type="llama", architectures=["LlamaForCausalLM"],
              vocab_size=f.tensors["token_embd.weight"].shape[0], hidden_size=d,
              intermediate_size=int(get("feed_forward_length")),
              num_hidden_layers=int(get("block_count")), num_attention_heads=heads,
              num_key_value_heads=int(get("attention.head_count_kv", heads)),
              head_dim=head_dim, max_position_embeddings=int(get("context_length", 2048)),
              rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
              hidden_act="silu", rope_theta=theta,
              rope_parameters=dict(rope_type="default", rope_theta=theta),
              attention_bias="blk.0.attn_q.bias" in f.tensors,
              mlp_bias="blk.0.ffn_up.bias" in f.tensors,
              tie_word_embeddings="output.weight" not in f.tensors)
    for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        hf[ours] = f.value(f"tokenizer.ggml.{key}")
    return hf


# ------------------------------------------------------------------ tensors
class TensorEntry(NamedTuple):
    """One tensor as `hf.load_pretrained` sees it: the GGUF tensor behind an HF name.

    dtype: safetensors code of what `GGUFCheckpoint.read` returns ("F32": every
    type is dequantized to float32); ggml_type: the type stored in the file.
    """
    gguf_name: str
    ggml_type: str
    shape: Tuple[int, ...]
    dtype: str = "F32"


class GGUFCheckpoint:
    """Tensor slices of a Llama GGUF file under their HF names, in HF's layout.

    The same interface as `safetensors_io.CheckpointReader` (`directory`, `tensors`,
    `in`, `shape`, `read`), plus `hf_config` (`read_hf_config` of the file).
    """

    def __init__(self, path: str):
        self.file = open_file(path)
        self.directory = path  # CheckpointReader's name, used by hf.py's messages
        self.hf_config = _hf_config(self.file)
        heads = {"attn_q": self.hf_config["num_attention_heads"],
                 "attn_k": self.hf_config["num_key_value_heads"]}
        self.tensors: Dict[str, TensorEntry] = {}
        self._heads: Dict[str, Optional[int]] = {}  # heads of the permuted Q / K tensors
        for name, t in self.file.tensors.items():
            hf_name = _hf_name(name)
            if hf_name is None:
                continue
            self.tensors[hf_name] = TensorEntry(name, t.ggml_type, t.shape)
            match = _GGUF_LAYER.fullmatch(name)
            self._heads[hf_name] = heads.get(match.group(2)) if match else None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> Tuple[int, ...]:
        return self.tensors[name].shape

    def read(self, name: str, index: Sequence[slice]) -> np.ndarray:
        """float32 tensor[index] in HF's layout (basic slices, step 1; 1-D or 2-D tensors)."""
        entry = self.tensors[name]
        shape = entry.shape
        if len(shape) not in (1, 2):
            raise CheckpointError(f"{self.directory}: tensor {entry.gguf_name!r} has shape "
                                  f"{shape}; only vectors and matrices are read")
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if any(s.indices(n)[2] != 1 for s, n in zip(index, shape)):
            raise ValueError(f"read({name!r}): only step-1 slices are supported, got {index}")
        heads = self._heads[name]
        if len(shape) == 1:  # a (small) vector: one row, read whole
            vector = self.file.read_rows(entry.gguf_name, np.zeros(1, np.int64))[0]
            if heads:
                vector = vector[_gguf_rows(np.arange(shape[0]), shape[0], heads)]
            return vector[index[0]]
        rows = np.arange(*index[0].indices(shape[0]))
        if heads:
            rows = _gguf_rows(rows, shape[0], heads)
        return self.file.read_rows(entry.gguf_name, rows, index[1])


def _hf_name(gguf_name: str) -> Optional[str]:
    """The HF Llama name of a llama.cpp tensor name (None for tensors HF has no name for)."""
    for hf, ours in _GLOBAL.items():
        if ours == gguf_name:
            return hf
    match = _GGUF_LAYER.fullmatch(gguf_name)
    if match is None:
        return None
    layer, module, kind = match.groups()
    for hf, ours in _LAYER.items():
        if ours == module:
            return f"model.layers.{layer}.{hf}.{kind}"
    return None


def _gguf_rows(rows: np.ndarray, n_rows: int, heads: int) -> np.ndarray:
    """The GGUF rows holding HF rows `rows` of a Q or K projection of `heads` heads.

    HF orders each head's rows (half, j): the two rotary halves one after the other;
    llama.cpp's converter stores them (j, half), interleaved. int64 [len(rows)].
    """
    head_dim = n_rows // heads
    head, within = np.divmod(rows, head_dim)
    half, j = np.divmod(within, head_dim // 2)
    return head * head_dim + 2 * j + half
