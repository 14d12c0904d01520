"""The tokenizer of a GGUF file as an HF fast tokenizer (no torch).

A GGUF file stores its vocabulary, merges, token types and special ids as
`tokenizer.ggml.*` metadata. transformers' GGUF converter
(`transformers.integrations.gguf.gguf_tokenizer_mapping.convert_gguf_tokenizer`) builds
the `tokenizers` backend from those values; transformers' own GGUF reader imports torch,
so the values are read here with the gguf package and handed to the converter the way
transformers does (same keys, same defaults), and the result wrapped as a
`PreTrainedTokenizerFast` with the file's special tokens, BOS / EOS flags and chat template.
"""
from __future__ import annotations

import os
from typing import List

from pjit_ppo.models.gguf_file import open_file

__all__ = ["load_tokenizer", "save_tokenizer"]

# Special-token attribute -> tokenizer.ggml.* id key.
_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
            "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def load_tokenizer(path: str):
    """A `transformers.PreTrainedTokenizerFast` built from GGUF file `path`'s vocabulary.

    Raises FileNotFoundError / CheckpointError for a missing or unreadable file and
    ValueError for a tokenizer type the converter does not know (it supports llama.cpp's
    "gpt2" byte-level BPE, "llama" sentencepiece BPE and "t5" unigram vocabularies).
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)
    f = open_file(path)
    if f.value("tokenizer.ggml.tokens") is None:
        raise ValueError(f"{path}: no tokenizer in the GGUF file (tokenizer.ggml.tokens)")
    groups = {group: {name: f.value(f"tokenizer.{key}") for key, name in keys.items()
                      if f.value(f"tokenizer.{key}") is not None}
              for group, keys in GGUF_TOKENIZER_MAPPING.items()}
    vocab, kwargs = groups["tokenizer"], groups["tokenizer_config"]
    if vocab.get("tokenizer_type") == "llama":  # llama.cpp adds BOS unless told otherwise
        kwargs.setdefault("add_bos_token", True)
    tokens = vocab["tokens"]
    for name, key in _SPECIAL.items():
        token_id = f.value(f"tokenizer.ggml.{key}")
        kwargs[name] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(f.value("general.architecture"), vocab)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs, **extra)


def save_tokenizer(path: str, out_dir: str) -> List[str]:
    """Writes the tokenizer of GGUF file `path` to `out_dir` as an HF tokenizer directory
    (tokenizer.json, tokenizer_config.json, ...: what `data.tokenizer_path` and
    `AutoTokenizer.from_pretrained` read); returns the file names written."""
    os.makedirs(out_dir, exist_ok=True)
    written = load_tokenizer(path).save_pretrained(out_dir)
    return sorted(os.path.basename(p) for p in written)
