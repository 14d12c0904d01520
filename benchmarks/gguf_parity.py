"""A GGUF file imported by pjit_ppo against transformers' own GGUF loading: the same
token ids from both tokenizers, and the float32 logits of one prompt.

  python benchmarks/gguf_parity.py PATH.gguf ["prompt text"]

Needs torch (the test extra). Prints the maximum and mean absolute logit difference,
the largest logit, and how often the two argmaxes agree.
"""
import os
import sys

import numpy as np

PROMPT = ("Lily has 23 apples. Lily gets 4 more apples. How many apples does Lily have now? "
          "The answer is")


def main(path: str, text: str = PROMPT) -> None:
    import jax.numpy as jnp
    import torch
    import transformers

    from pjit_ppo.data.prompts import load_tokenizer
    from pjit_ppo.models import lm_logits, load_pretrained

    config, params = load_pretrained(path, dtype="float32")
    ids = load_tokenizer(path)(text, add_special_tokens=False)["input_ids"]
    x = jnp.asarray([ids], jnp.int32)
    ours = np.asarray(lm_logits(config, params, x, jnp.ones_like(x, bool)))

    directory, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                              dtype=torch.float32)
    their_ids = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)(
        text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits.numpy()
    diff = np.abs(ours - theirs)
    print(f"tokens {len(ids)}, same token ids: {their_ids == ids}")
    print(f"max |logit difference| {diff.max():.3g}, mean {diff.mean():.3g}, "
          f"max |logit| {np.abs(theirs).max():.3g}, argmax agreement "
          f"{(ours.argmax(-1) == theirs.argmax(-1)).mean():.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
