"""A tiny word-level HF tokenizer and toy English-like text for the SFT and reward tests.

The vocabulary is a few dozen words, so a model of vocab_size VOCAB (d_model 32) learns
the grammar in a few dozen steps on CPU.
"""
import os

import numpy as np

SUBJECTS = ("the cat", "a dog", "my friend", "the bird")
VERBS = ("sees", "likes", "eats", "finds")
OBJECTS = ("the fish", "a ball", "some bread", "the tree")
GOOD = ("good", "great", "nice", "happy")
BAD = ("bad", "awful", "sad", "poor")
SPECIAL = ("[UNK]", "<pad>", "<eos>")
WORDS = sorted({w for phrase in SUBJECTS + VERBS + OBJECTS for w in phrase.split()}
               | set(GOOD) | set(BAD) | {"very", "and", "."})
VOCAB = 64  # the models' embedding rows (more than the tokenizer's ids)


def save_tokenizer(directory: str) -> int:
    """Saves a word-level transformers tokenizer (pad "<pad>", eos "<eos>") in `directory`;
    returns its length."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(SPECIAL + tuple(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<pad>",
                                   eos_token="<eos>")
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    return len(fast)


def sentences(n: int, seed: int = 0):
    """n grammatical sentences: subject verb object [very] adjective ."""
    r = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        adjective = r.choice(GOOD + BAD)
        very = "very " if r.random() < 0.3 else ""
        out.append(f"{r.choice(SUBJECTS)} {r.choice(VERBS)} {r.choice(OBJECTS)} "
                   f"{very}{adjective} .")
    return out


def model_random(**overrides) -> dict:
    """model.random: a tiny GPT-2 over VOCAB ids."""
    cfg = dict(model_type="gpt2", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
               n_positions=64, activation_function="gelu_new", bos_token_id=2, eos_token_id=2,
               pad_token_id=1)
    cfg.update(overrides)
    return cfg
