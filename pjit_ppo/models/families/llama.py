"""Llama (`llama`): RMSNorm, SwiGLU MLP, grouped-query attention, rotary on halves."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from pjit_ppo.models.families import layout
from pjit_ppo.models.families.config_json import activation, hf_activation, rope
from pjit_ppo.models.families.family import Family
from pjit_ppo.models.families.layout import Maps

if TYPE_CHECKING:
    from pjit_ppo.models.config import ModelConfig


def config_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """ModelConfig fields of a Llama config.json."""
    d = hf["hidden_size"]
    h = hf["num_attention_heads"]
    hd = hf.get("head_dim") or d // h
    theta, partial = rope(hf)
    bias = bool(hf.get("attention_bias", False))
    return dict(vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"],
                n_heads=h, n_kv_heads=hf.get("num_key_value_heads") or h, head_dim=hd,
                d_ff=hf["intermediate_size"], max_positions=hf.get("max_position_embeddings", 2048),
                norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
                activation=activation(hf.get("hidden_act", "silu")), gated_mlp=True,
                position="rotary", rotary_dim=int(hd * partial), rope_theta=theta,
                qkv_bias=bias, attn_out_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))


def hf_fields(c: ModelConfig) -> Dict[str, Any]:
    """Llama config.json entries of a hand-built config (old and new rope keys)."""
    return dict(vocab_size=c.vocab_size, hidden_size=c.d_model, num_hidden_layers=c.n_layers,
                num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                head_dim=c.head_dim, intermediate_size=c.d_ff,
                max_position_embeddings=c.max_positions, rms_norm_eps=c.norm_eps,
                hidden_act=hf_activation(c.activation), rope_theta=c.rope_theta,
                rope_parameters=dict(rope_type="default", rope_theta=c.rope_theta),
                attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias,
                tie_word_embeddings=c.tie_word_embeddings)


def tensor_maps(c: ModelConfig) -> Maps:
    """Every parameter of a Llama model in `model.*` tensors (+ `lm_head`)."""
    p = "model.layers.{i}"
    maps = {("transformer/embed", "embeddings"): layout.identity("model.embed_tokens.weight",
                                                                 (c.vocab_size, c.d_model), False)}
    layout.norms(maps, c, p, [("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")])
    layout.separate_qkv(maps, c, p, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                     "self_attn.o_proj"], c.qkv_bias)
    if c.attn_out_bias:
        maps[("transformer/layers/attn/o", "b")] = layout.identity(f"{p}.self_attn.o_proj.bias",
                                                                   (c.d_model,))
    layout.mlp(maps, c, p, [("fc_in", "mlp.up_proj"), ("fc_gate", "mlp.gate_proj"),
                            ("fc_out", "mlp.down_proj")])
    layout.final_norm_and_head(maps, c, "model.norm")
    return maps


FAMILY = Family(model_type="llama", hf_class="LlamaForCausalLM", base_prefix="model.",
                config_fields=config_fields, hf_fields=hf_fields, tensor_maps=tensor_maps)
