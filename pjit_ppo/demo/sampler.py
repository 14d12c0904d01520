"""Decoded continuations of text prompts from an HF policy directory (the demo's labelling
and gold scoring use it; PPO and evaluation sample inside their compiled programs)."""
from __future__ import annotations

import functools
from typing import List, Sequence

import jax
import numpy as np

from pjit_ppo import sampling, sharding
from pjit_ppo.data.prompts import tokenize_queries
from pjit_ppo.models import load_pretrained
from pjit_ppo.sample_table import truncated


def continuations(policy_dir: str, tokenizer, prompts: Sequence[str], *, samples: int,
                  query_length: int, response_length: int, temperature: float, pad_id: int,
                  stop_token: int, truncate_after: int, seed: int,
                  batch_size: int = 256) -> List[List[str]]:
    """`samples` sampled continuations of each prompt, cut after the stop token (as a
    reward model sees them), decoded: [len(prompts)][samples] strings."""
    mesh = sharding.make_mesh(1, -1, 1)
    model_cfg, params = load_pretrained(policy_dir, mesh=mesh)
    rows = np.repeat(tokenize_queries(prompts, tokenizer, query_length, pad_id), samples, 0)
    n = len(rows)
    step = max(1, batch_size // mesh.size) * mesh.size
    padded = np.concatenate([rows, np.full((-n % step, query_length), pad_id, np.int32)])
    padded[n:, -1] = rows[0, -1]  # filler rows need one real token; their output is dropped
    batch_sh = sharding.batch_sharding(mesh, 2)

    @functools.partial(jax.jit, out_shardings=sharding.replicated(mesh))
    def draw(params, query, key):
        return sampling.generate(model_cfg, params, query, query != pad_id, key,
                                 max_new_tokens=response_length, temperature=temperature,
                                 mesh=mesh)[0]

    out = []
    for i in range(0, len(padded), step):
        query = jax.device_put(padded[i:i + step], batch_sh)
        out.append(np.asarray(draw(params, query, jax.random.fold_in(jax.random.PRNGKey(seed),
                                                                       i))))
    tokens = truncated(np.concatenate(out)[:n], stop_token, truncate_after, pad_id)
    texts = [tokenizer.decode([int(t) for t in row if t != pad_id]) for row in tokens]
    return [texts[j * samples:(j + 1) * samples] for j in range(len(prompts))]
