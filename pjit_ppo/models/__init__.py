"""Models: one Haiku decoder for GPT-J / GPT-2 / GPT-NeoX / Llama, scalar heads, HF I/O.

The names users import are re-exported here; the modules behind them may move.
"""
from pjit_ppo.models import heads
from pjit_ppo.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelConfigError
from pjit_ppo.models.hf import load_pretrained, save_pretrained
from pjit_ppo.models.token_logprobs import head_token_logprobs
from pjit_ppo.models.transformer import (KVCache, PrefixKVCache, forward, hidden_states,
                                         init_kv_cache, init_params, lm_head_logits,
                                         lm_head_weights, lm_logits, param_shapes)

__all__ = [
    "heads", "SUPPORTED_ARCHITECTURES", "ModelConfig", "ModelConfigError", "load_pretrained",
    "save_pretrained", "head_token_logprobs", "KVCache", "PrefixKVCache", "forward",
    "hidden_states", "init_kv_cache", "init_params", "lm_head_logits", "lm_head_weights",
    "lm_logits", "param_shapes",
]
