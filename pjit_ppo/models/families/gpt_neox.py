"""GPT-NeoX / Pythia (`gpt_neox`): partial rotary, q/k/v fused per head, head `embed_out`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from pjit_ppo.models.families import layout
from pjit_ppo.models.families.config_json import activation, hf_activation, rope
from pjit_ppo.models.families.family import Family
from pjit_ppo.models.families.layout import Maps, TensorMap

if TYPE_CHECKING:
    from pjit_ppo.models.config import ModelConfig


def config_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """ModelConfig fields of a GPT-NeoX config.json."""
    d = hf["hidden_size"]
    hd = d // hf["num_attention_heads"]
    theta, partial = rope(hf)
    bias = hf.get("attention_bias", True)
    return dict(vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"],
                n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_attention_heads"],
                head_dim=hd, d_ff=hf["intermediate_size"],
                max_positions=hf.get("max_position_embeddings", 2048), norm="layernorm",
                norm_eps=hf.get("layer_norm_eps", 1e-5),
                activation=activation(hf.get("hidden_act", "gelu")), position="rotary",
                rotary_dim=int(hd * partial), rope_theta=theta,
                parallel_residual=bool(hf.get("use_parallel_residual", True)),
                qkv_bias=bias, attn_out_bias=bias, mlp_bias=True,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))


def hf_fields(c: ModelConfig) -> Dict[str, Any]:
    """GPT-NeoX config.json entries of a hand-built config (old and new rope keys)."""
    partial = c.rotary_dim / c.head_dim
    return dict(vocab_size=c.vocab_size, hidden_size=c.d_model, num_hidden_layers=c.n_layers,
                num_attention_heads=c.n_heads, intermediate_size=c.d_ff,
                max_position_embeddings=c.max_positions, layer_norm_eps=c.norm_eps,
                hidden_act=hf_activation(c.activation), rotary_pct=partial,
                rotary_emb_base=c.rope_theta,
                rope_parameters=dict(rope_type="default", rope_theta=c.rope_theta,
                                     partial_rotary_factor=partial),
                use_parallel_residual=c.parallel_residual, attention_bias=c.qkv_bias,
                tie_word_embeddings=c.tie_word_embeddings)


def tensor_maps(c: ModelConfig) -> Maps:
    """Every parameter of a GPT-NeoX model in `gpt_neox.*` tensors (+ `embed_out`)."""
    d, h, hd = c.d_model, c.n_heads, c.head_dim
    p = "gpt_neox.layers.{i}"
    maps = {("transformer/embed", "embeddings"): layout.identity("gpt_neox.embed_in.weight",
                                                                 (c.vocab_size, d), False)}
    layout.norms(maps, c, p, [("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")])
    for j, ours in enumerate("qkv"):  # rows: (head, {q, k, v}, head_dim)
        maps[(f"transformer/layers/attn/{ours}", "w")] = TensorMap(
            f"{p}.attention.query_key_value.weight", ((h, 3, hd), (d,)), (3, 0, 2), ((1, j),))
        if c.qkv_bias:
            maps[(f"transformer/layers/attn/{ours}", "b")] = TensorMap(
                f"{p}.attention.query_key_value.bias", ((h, 3, hd),), (0, 2), ((1, j),))
    maps[("transformer/layers/attn/o", "w")] = layout.linear_from_heads(
        f"{p}.attention.dense.weight", (h, hd), d)
    if c.attn_out_bias:
        maps[("transformer/layers/attn/o", "b")] = layout.identity(
            f"{p}.attention.dense.bias", (d,))
    layout.mlp(maps, c, p, [("fc_in", "mlp.dense_h_to_4h"), ("fc_out", "mlp.dense_4h_to_h")])
    layout.final_norm_and_head(maps, c, "gpt_neox.final_layer_norm", head="embed_out")
    return maps


FAMILY = Family(model_type="gpt_neox", hf_class="GPTNeoXForCausalLM", base_prefix="gpt_neox.",
                config_fields=config_fields, hf_fields=hf_fields, tensor_maps=tensor_maps,
                # transformers 5 calls the LM head lm_head.
                aliases={"embed_out.weight": ("lm_head.weight",)})
