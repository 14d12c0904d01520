"""A byte-level BPE tokenizer trained on the demo corpus, saved for AutoTokenizer."""
from __future__ import annotations

import os
from typing import Iterable

PAD, EOS = "<pad>", "<|endoftext|>"


def train_tokenizer(lines: Iterable[str], directory: str, vocab_size: int = 384) -> int:
    """Trains byte-level BPE on `lines`, saves a transformers tokenizer in `directory`
    (loadable with AutoTokenizer.from_pretrained) and returns its length (ids in use).

    Special tokens: <|endoftext|> (eos/bos) and <pad> (the pad token, which no text maps to).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                   pad_token=PAD, clean_up_tokenization_spaces=False)
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    return len(fast)
