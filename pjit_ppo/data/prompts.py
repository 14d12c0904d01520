"""Text prompts from local files, tokenised with an HF tokenizer, as batch-sharded arrays.

Sources: JSONL (one object per line, the prompt under a configurable key), plain text
(one prompt per line), or a directory written by HF `datasets` (`save_to_disk`).
Prompts are tokenised without special tokens, optionally trimmed to the text after
`start_text` / up to `end_text` (lm-human-preferences' query trimming), truncated to
their last `query_length` tokens (the ones next to the response) and left-padded.

The order over a run is a pure function of (seed, iteration): epoch e is a fresh
permutation of the prompt set drawn from `rng.stream_key(seed, "prompts", e)`, and
iteration t takes positions [t*P, (t+1)*P) of the concatenated epochs. A resumed run
therefore continues exactly where the checkpoint left off, with any number of
processes; `TextPrompts.position(t)` is what a checkpoint records. Each process
tokenises only the rows its own devices hold.

Prompt records keep their other fields as metadata (`{"prompt": "...", "answer": "42",
"difficulty": 3}`; the other columns of an HF dataset): they stay on the host and travel
with their row by index (`TextPrompts.records(iteration, rows, samples_per_prompt)`:
prompt texts and {field: one value per row}), for reward functions
(`pjit_ppo.rewards.host`) and the sample tables. A checkpoint records their digest too
(`position()["metadata_fingerprint"]`), so a resume on changed metadata is refused.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import Mesh

from pjit_ppo import rng, sharding
from pjit_ppo.data.formats import detect_format
from pjit_ppo.errors import DataError

FORMATS = ("auto", "jsonl", "text", "hf_dataset")


def load_prompt_texts(path: str, fmt: str = "auto", field: str = "prompt") -> List[str]:
    """Every prompt of a local file or saved HF dataset, as strings, in file order.

    Raises DataError naming the file (and line or field) for a missing file, a line
    that is not JSON or lacks `field`, a value that is not a string, or no prompts.
    """
    return load_prompt_records(path, fmt, field)[0]


def load_prompt_records(path: str, fmt: str = "auto", field: str = "prompt"
                        ) -> Tuple[List[str], List[Dict[str, Any]]]:
    """(prompt texts, metadata): every record of a prompts file in file order, its prompt
    text and a dict of its other fields (JSONL keys, HF dataset columns; {} for plain
    text). DataError as in `load_prompt_texts`."""
    if not path:
        raise DataError("no prompts file given: set data.prompts_path")
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file or directory (data.prompts_path)")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise DataError(f"{path}: unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "hf_dataset":
        texts, metadata = _load_hf_dataset(path, field)
    else:
        if os.path.isdir(path):
            raise DataError(f"{path} is a directory; data.prompts_format={fmt!r} reads a file")
        if fmt == "jsonl":
            texts, metadata = _load_jsonl(path, field)
        else:
            texts = _load_text(path)
            metadata = [{} for _ in texts]
    if not texts:
        raise DataError(f"{path}: no prompts in it (an empty dataset)")
    return texts, metadata


def _load_text(path: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def _load_jsonl(path: str, field: str) -> Tuple[List[str], List[Dict[str, Any]]]:
    texts, metadata = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or field not in record:
                raise DataError(f"{path}:{number}: no field {field!r} (data.prompt_field)")
            if not isinstance(record[field], str):
                raise DataError(f"{path}:{number}: field {field!r} is "
                                f"{type(record[field]).__name__}, not a string")
            texts.append(record[field])
            metadata.append({k: v for k, v in record.items() if k != field})
    return texts, metadata


def _load_hf_dataset(path: str, field: str) -> Tuple[List[str], List[Dict[str, Any]]]:
    try:
        import datasets  # optional: only needed for saved HF datasets
    except ImportError:
        raise DataError(f"{path} is a saved HF dataset, and the `datasets` package is not "
                        f"installed: pip install datasets") from None
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 -- any failure here is the user's directory
        raise DataError(f"{path}: not a dataset saved by datasets.save_to_disk "
                        f"({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{path} holds splits {sorted(ds)}; point data.prompts_path at one "
                        f"split's directory")
    if field not in ds.column_names:
        raise DataError(f"{path}: no column {field!r} (data.prompt_field); columns: "
                        f"{ds.column_names}")
    others = [c for c in ds.column_names if c != field]
    columns = {c: list(ds[c]) for c in others}
    texts = [str(t) for t in ds[field]]
    return texts, [{c: columns[c][i] for c in others} for i in range(len(texts))]


def load_tokenizer(path: str):
    """`transformers.AutoTokenizer.from_pretrained(path)` with one-line errors; for a
    llama.cpp `.gguf` file, the HF tokenizer built from its vocabulary."""
    if not path:
        raise DataError("no tokenizer given: set data.tokenizer_path (or model.policy_path "
                        "to a directory that holds one)")
    if path.lower().endswith(".gguf") and os.path.isfile(path):
        from pjit_ppo.models import gguf
        try:
            return gguf.load_tokenizer(path)
        except Exception as e:  # noqa: BLE001 -- report what could not be read
            raise DataError(f"{path}: no tokenizer could be built from this GGUF file "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if not os.path.isdir(path):
        raise DataError(f"{path}: tokenizer directory not found (data.tokenizer_path)")
    import transformers
    try:
        if _plain_tokenizers_directory(path):
            return transformers.PreTrainedTokenizerFast.from_pretrained(path)
        return transformers.AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- report what transformers could not read
        raise DataError(f"{path}: not a tokenizer directory transformers can load "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


#: The `tokenizer_class` names of a tokenizer that is only its `tokenizer.json` (the class
#: `tokenizers` users and our demo save; transformers 5 names it TokenizersBackend).
_PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
#: Model types (config.json `model_type`, the families pjit_ppo reads) for which
#: AutoTokenizer keeps a plain tokenizer's own class: transformers 5 maps them to no
#: tokenizer of their own (llama) or to one it replaces by the declared TokenizersBackend
#: (gpt2, gptj, gpt_neox). tests/test_prompts.py checks this against AutoTokenizer.
_PLAIN_TOKENIZER_MODEL_TYPES = ("gpt2", "gptj", "gpt_neox", "llama")


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _plain_tokenizers_directory(path: str) -> bool:
    """Whether `path` holds a plain `tokenizers` tokenizer, alone or beside the config of
    a model of a family pjit_ppo reads: then AutoTokenizer would pick
    PreTrainedTokenizerFast (= TokenizersBackend) itself, and naming the class skips
    AutoConfig, whose import pulls in PyTorch (2-4 s of every launch that reads text).
    Any other directory goes through AutoTokenizer."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return False
    model_config_path = os.path.join(path, "config.json")
    if os.path.exists(model_config_path):
        model_config = _read_json(model_config_path)
        if (not isinstance(model_config, dict)
                or model_config.get("model_type") not in _PLAIN_TOKENIZER_MODEL_TYPES
                or "auto_map" in model_config or "tokenizer_class" in model_config):
            return False
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    return (isinstance(config, dict) and "auto_map" not in config
            and config.get("tokenizer_class") in _PLAIN_TOKENIZER_CLASSES)


def check_tokenizer(tokenizer, *, path: str, vocab_size: int, pad_id: int,
                    stop_token: Optional[int]) -> None:
    """Checks the tokenizer fits the model and the config's special ids.

    Every id the tokenizer can produce must be an embedding row (len(tokenizer) <=
    vocab_size). The pad id must be the tokenizer's own pad token or an id no text
    maps to (>= len(tokenizer), lm-human-preferences' dedicated pad); a stop token
    must be a token of the tokenizer.
    """
    n = len(tokenizer)
    if n > vocab_size:
        raise DataError(f"{path}: the tokenizer has {n} tokens but the model's embedding has "
                        f"{vocab_size} rows; use the model's own tokenizer")
    if pad_id < n and pad_id != tokenizer.pad_token_id:
        token = tokenizer.convert_ids_to_tokens(pad_id)
        own = tokenizer.pad_token_id
        fix = (f"set ppo.pad_token_id={own} (its pad token)" if own is not None
               else f"set ppo.pad_token_id to an id >= {n} or add a pad token")
        raise DataError(f"{path}: ppo.pad_token_id={pad_id} is the text token {token!r}, "
                        f"so real text would be masked as padding; {fix}")
    if stop_token is not None and not 0 <= stop_token < n:
        raise DataError(f"{path}: the tokenizer has no token id {stop_token} "
                        f"(ppo.truncate_token); it has ids 0..{n - 1}")


def trim(text: str, start_text: str = "", end_text: str = "") -> str:
    """The text after the first `start_text` and up to the end of the last `end_text`
    (each only when given and present)."""
    if start_text and start_text in text:
        text = text[text.index(start_text) + len(start_text):]
    if end_text and end_text in text:
        text = text[:text.rindex(end_text) + len(end_text)]
    return text


def tokenize_queries(texts: Sequence[str], tokenizer, query_length: int, pad_id: int,
                     start_text: str = "", end_text: str = "") -> np.ndarray:
    """Left-padded query ids: int32 [N, query_length].

    Each text is trimmed (`trim`), tokenised without special tokens, and cut to its
    last `query_length` tokens. A prompt with no tokens is all padding.
    """
    out = np.full((len(texts), query_length), pad_id, np.int32)
    if not len(texts):
        return out
    ids = tokenizer([trim(t, start_text, end_text) for t in texts],
                    add_special_tokens=False)["input_ids"]
    for row, tokens in enumerate(ids):
        tokens = tokens[-query_length:] if query_length else []
        if tokens:
            out[row, query_length - len(tokens):] = tokens
    return out


def decode(tokenizer, ids: np.ndarray, pad_id: int) -> List[str]:
    """Texts of int [N, L] rows, padding dropped."""
    return [tokenizer.decode([int(t) for t in row if t != pad_id]) for row in np.asarray(ids)]


def fingerprint(texts: Sequence[str]) -> str:
    """A short digest of the prompt set (order included): a resumed run checks it."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def metadata_fingerprint(metadata: Optional[Sequence[Dict[str, Any]]]) -> Optional[str]:
    """A short digest of the records' metadata (order included), None when no record has
    any: a resumed run checks it beside `fingerprint`."""
    if not metadata or not any(metadata):
        return None
    h = hashlib.sha256()
    for record in metadata:
        h.update(json.dumps(record, sort_keys=True, default=str,
                            ensure_ascii=False).encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


class TextPrompts:
    """A PromptFn over a prompt set: iteration -> (int32 [P, Q], bool [P, Q]).

    P = prompts per iteration. Rows are batch-sharded on `mesh`; each process
    tokenises only the rows of its addressable devices. Deterministic in
    (seed, iteration); see the module docstring. `metadata`: one dict of extra
    fields per prompt (None or empty dicts: none), kept on the host (`records`).
    """

    def __init__(self, mesh: Mesh, texts: Sequence[str], tokenizer, *, batch_size: int,
                 query_length: int, pad_id: int, seed: int, shuffle: bool = True,
                 start_text: str = "", end_text: str = "", purpose: str = "prompts",
                 source: str = "", metadata: Optional[Sequence[Dict[str, Any]]] = None):
        self.texts = list(texts)
        if not self.texts:
            raise DataError(f"{source or 'prompts'}: no prompts (an empty dataset)")
        self.metadata = [dict(m) for m in metadata] if metadata is not None else \
            [{} for _ in self.texts]
        if len(self.metadata) != len(self.texts):
            raise ValueError(f"{len(self.metadata)} metadata records for {len(self.texts)} "
                             f"prompts")
        #: The metadata fields of the prompt set (the union over records), sorted.
        self.fields = tuple(sorted({k for m in self.metadata for k in m}))
        self.metadata_fingerprint = metadata_fingerprint(self.metadata)
        self.tokenizer = tokenizer
        self.batch_size, self.query_length, self.pad_id = batch_size, query_length, pad_id
        self.seed, self.shuffle, self.purpose = seed, shuffle, purpose
        self.start_text, self.end_text = start_text, end_text
        self.source = source
        self.fingerprint = fingerprint(self.texts)
        self._sharding = sharding.batch_sharding(mesh, 2)
        self._perms: Dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        """The permutation of epoch `epoch` (the last two are kept)."""
        if epoch not in self._perms:
            n = len(self.texts)
            key = rng.stream_key(self.seed, self.purpose, epoch)
            perm = np.asarray(jax.random.permutation(key, n)) if self.shuffle else np.arange(n)
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = perm
        return self._perms[epoch]

    def indices(self, iteration: int) -> np.ndarray:
        """Prompt-set indices of iteration's rows: int64 [P]."""
        n = len(self.texts)
        positions = np.arange(iteration * self.batch_size, (iteration + 1) * self.batch_size)
        out = np.empty(self.batch_size, np.int64)
        for epoch in np.unique(positions // n):
            sel = positions // n == epoch
            out[sel] = self._order(int(epoch))[positions[sel] % n]
        return out

    def position(self, iteration: int) -> Dict[str, Any]:
        """Where the stream stands before `iteration` (JSON-able, saved in checkpoints)."""
        consumed = iteration * self.batch_size
        out = {"kind": "text", "source": self.source, "num_prompts": len(self.texts),
               "fingerprint": self.fingerprint, "seed": self.seed,
               "epoch": consumed // len(self.texts), "index_in_epoch": consumed % len(self.texts),
               "next_iteration": iteration}
        if self.metadata_fingerprint is not None:
            out["metadata_fingerprint"] = self.metadata_fingerprint
        return out

    def texts_of(self, iteration: int) -> List[str]:
        """The prompt texts of an iteration's rows (for logs)."""
        return [self.texts[i] for i in self.indices(iteration)]

    def records(self, iteration: int, rows: Sequence[int], samples_per_prompt: int = 1
                ) -> Tuple[List[str], Dict[str, list]]:
        """The prompt records of episodes `rows` of an iteration's batch, in that order.

        Episode b of the batch (its prompts each repeated `samples_per_prompt` (G) times
        in contiguous rows) is a sample of prompt row b // G. Returns (the original
        prompt texts, {field: one value per row} for every field of `fields`; None
        where a record lacks the field).
        """
        index = self.indices(iteration)
        chosen = [int(index[int(b) // samples_per_prompt]) for b in rows]
        metadata = {f: [self.metadata[i].get(f) for i in chosen] for f in self.fields}
        return [self.texts[i] for i in chosen], metadata

    def __call__(self, iteration: int) -> Tuple[jax.Array, jax.Array]:
        idx = self.indices(iteration)
        shape = (self.batch_size, self.query_length)
        cache: Dict[Tuple[int, int], np.ndarray] = {}

        def rows(index) -> np.ndarray:
            lo, hi, _ = index[0].indices(self.batch_size)
            if (lo, hi) not in cache:
                cache[(lo, hi)] = tokenize_queries(
                    [self.texts[i] for i in idx[lo:hi]], self.tokenizer, self.query_length,
                    self.pad_id, self.start_text, self.end_text)
            return cache[(lo, hi)][:, index[1]]

        query = jax.make_array_from_callback(shape, self._sharding, rows)
        mask = jax.make_array_from_callback(
            shape, self._sharding, lambda index: rows(index) != self.pad_id)
        return query, mask


def text_prompts(mesh: Mesh, data_options, *, batch_size: int, query_length: int, pad_id: int,
                 seed: int, vocab_size: int, stop_token: Optional[int],
                 tokenizer_path: str, purpose: str = "prompts",
                 texts: Optional[List[str]] = None) -> TextPrompts:
    """TextPrompts from a RunConfig's `data` section (checks the tokenizer first)."""
    tokenizer = load_tokenizer(tokenizer_path)
    check_tokenizer(tokenizer, path=tokenizer_path, vocab_size=vocab_size, pad_id=pad_id,
                    stop_token=stop_token)
    metadata = None
    if texts is None:
        texts, metadata = load_prompt_records(data_options.prompts_path,
                                              data_options.prompts_format,
                                              data_options.prompt_field)
    return TextPrompts(mesh, texts, tokenizer, batch_size=batch_size, query_length=query_length,
                       pad_id=pad_id, seed=seed, shuffle=data_options.shuffle,
                       start_text=data_options.start_text, end_text=data_options.end_text,
                       purpose=purpose, source=data_options.prompts_path, metadata=metadata)
