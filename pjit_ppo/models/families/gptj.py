"""GPT-J (`gptj`): interleaved partial rotary, one layer norm feeding parallel attn + MLP."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from pjit_ppo.models.families import layout
from pjit_ppo.models.families.config_json import activation, hf_activation
from pjit_ppo.models.families.family import Family
from pjit_ppo.models.families.layout import Maps

if TYPE_CHECKING:
    from pjit_ppo.models.config import ModelConfig


def config_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """ModelConfig fields of a GPT-J config.json."""
    d = hf["n_embd"]
    hd = d // hf["n_head"]
    tied = bool(hf.get("tie_word_embeddings", False))
    return dict(vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["n_layer"],
                n_heads=hf["n_head"], n_kv_heads=hf["n_head"], head_dim=hd,
                d_ff=hf.get("n_inner") or 4 * d, max_positions=hf["n_positions"],
                norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                activation=activation(hf.get("activation_function", "gelu_new")),
                position="rotary", rotary_dim=hf.get("rotary_dim") or hd, rotary_interleaved=True,
                parallel_residual=True, shared_parallel_norm=True, qkv_bias=False,
                attn_out_bias=False, mlp_bias=True, tie_word_embeddings=tied,
                lm_head_bias=not tied)


def hf_fields(c: ModelConfig) -> Dict[str, Any]:
    """GPT-J config.json entries of a hand-built config."""
    return dict(vocab_size=c.vocab_size, n_embd=c.d_model, n_layer=c.n_layers, n_head=c.n_heads,
                n_inner=c.d_ff, n_positions=c.max_positions, rotary_dim=c.rotary_dim,
                layer_norm_epsilon=c.norm_eps, activation_function=hf_activation(c.activation),
                tie_word_embeddings=c.tie_word_embeddings)


def tensor_maps(c: ModelConfig) -> Maps:
    """Every parameter of a GPT-J model in `transformer.*` tensors (+ `lm_head`)."""
    p = "transformer.h.{i}"
    maps = {("transformer/embed", "embeddings"): layout.identity("transformer.wte.weight",
                                                                 (c.vocab_size, c.d_model), False)}
    layout.norms(maps, c, p, [("ln_1", "ln_1")])
    layout.separate_qkv(maps, c, p, ["attn.q_proj", "attn.k_proj", "attn.v_proj",
                                     "attn.out_proj"], c.qkv_bias)
    layout.mlp(maps, c, p, [("fc_in", "mlp.fc_in"), ("fc_out", "mlp.fc_out")])
    layout.final_norm_and_head(maps, c, "transformer.ln_f")
    return maps


FAMILY = Family(model_type="gptj", hf_class="GPTJForCausalLM", base_prefix="transformer.",
                config_fields=config_fields, hf_fields=hf_fields, tensor_maps=tensor_maps)
