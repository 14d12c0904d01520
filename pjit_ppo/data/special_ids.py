"""The pad and stop ids a run takes from its tokenizer when the config says so
(`FROM_TOKENIZER`, -1), so a recipe for any checkpoint needs no model-specific ids."""
from typing import Dict

from pjit_ppo.config.sections import FROM_TOKENIZER, SequenceOptions
from pjit_ppo.errors import DataError


def resolve_token_ids(sequences: SequenceOptions, tokenizer, *, vocab_size: int, prefix: str,
                      tokenizer_path: str = "") -> Dict[str, int]:
    """Replaces FROM_TOKENIZER in `sequences.pad_token_id` / `truncate_token`, in place.

    pad: the tokenizer's pad token; without one, the first embedding row past the
    tokenizer's ids (a dedicated pad no text maps to, as lm-human-preferences does).
    stop (truncate_token): the tokenizer's EOS token.

    Args:
      sequences: a config's SequenceOptions (PPOConfig, RewardLearningConfig).
      tokenizer: an HF tokenizer (`pjit_ppo.data.prompts.load_tokenizer`).
      vocab_size: the model's embedding rows.
      prefix: how the user types the fields ("ppo." or ""), for messages.
    Returns {field: id} for each field it resolved. Raises DataError when the tokenizer
    has no such token and the model has no spare row, naming the field to set.
    """
    resolved = {}
    where = tokenizer_path or "the tokenizer"
    if sequences.pad_token_id == FROM_TOKENIZER:
        pad = tokenizer.pad_token_id
        if pad is None:
            if len(tokenizer) >= vocab_size:
                raise DataError(f"{where} has no pad token and the model's {vocab_size} "
                                f"embedding rows are all text tokens: set "
                                f"{prefix}pad_token_id to an id no prompt contains")
            pad = len(tokenizer)
        sequences.pad_token_id = resolved["pad_token_id"] = int(pad)
    if sequences.truncate_token == FROM_TOKENIZER:
        if tokenizer.eos_token_id is None:
            raise DataError(f"{where} has no EOS token: set {prefix}truncate_token to the id "
                            f"that ends a response, or None for no truncation")
        sequences.truncate_token = resolved["truncate_token"] = int(tokenizer.eos_token_id)
    return resolved


def needs_tokenizer(sequences: SequenceOptions) -> bool:
    """Whether a field of `sequences` says FROM_TOKENIZER."""
    return FROM_TOKENIZER in (sequences.pad_token_id, sequences.truncate_token)


def resolve_from_path(sequences: SequenceOptions, tokenizer_path: str, *, vocab_size: int,
                      prefix: str) -> Dict[str, int]:
    """`resolve_token_ids` with the tokenizer at `tokenizer_path` (an HF directory or a
    .gguf file), loaded only when a field needs it. Raises DataError when none is given."""
    if not needs_tokenizer(sequences):
        return {}
    if not tokenizer_path:
        raise DataError(f"{prefix}pad_token_id / {prefix}truncate_token = -1 take their ids "
                        f"from the tokenizer, and there is none: set the tokenizer path (or "
                        f"model.policy_path), or give the ids")
    from pjit_ppo.data.prompts import load_tokenizer
    return resolve_token_ids(sequences, load_tokenizer(tokenizer_path), vocab_size=vocab_size,
                             prefix=prefix, tokenizer_path=tokenizer_path)
