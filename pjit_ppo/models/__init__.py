"""Models: one Haiku decoder for GPT-J / GPT-2 / GPT-NeoX / Llama, scalar heads, HF I/O."""
from pjit_ppo.models.config import ModelConfig, ModelConfigError, SUPPORTED_ARCHITECTURES
from pjit_ppo.models.transformer import (KVCache, forward, hidden_states, init_kv_cache,
                                         init_params, lm_head_logits, lm_logits, param_shapes,
                                         position_ids_from_mask)
from pjit_ppo.models.hf import load_pretrained, save_pretrained
