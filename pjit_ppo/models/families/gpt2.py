"""GPT-2 (`gpt2`): learned positions, Conv1D weights with fused q|k|v, tied LM head."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from pjit_ppo.models.families import layout
from pjit_ppo.models.families.config_json import ModelConfigError, activation, hf_activation
from pjit_ppo.models.families.family import Family
from pjit_ppo.models.families.layout import Maps, TensorMap

if TYPE_CHECKING:
    from pjit_ppo.models.config import ModelConfig


def config_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """ModelConfig fields of a GPT-2 config.json."""
    d = hf["n_embd"]
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
        raise ModelConfigError("GPT-2 attention-scaling variants are not supported")
    return dict(vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["n_layer"],
                n_heads=hf["n_head"], n_kv_heads=hf["n_head"], head_dim=d // hf["n_head"],
                d_ff=hf.get("n_inner") or 4 * d, max_positions=hf["n_positions"],
                norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                activation=activation(hf.get("activation_function", "gelu_new")),
                position="learned", qkv_bias=True, attn_out_bias=True, mlp_bias=True,
                tie_word_embeddings=True, lm_head_bias=False)


def hf_fields(c: ModelConfig) -> Dict[str, Any]:
    """GPT-2 config.json entries of a hand-built config."""
    return dict(vocab_size=c.vocab_size, n_embd=c.d_model, n_layer=c.n_layers, n_head=c.n_heads,
                n_inner=c.d_ff, n_positions=c.max_positions, layer_norm_epsilon=c.norm_eps,
                activation_function=hf_activation(c.activation), tie_word_embeddings=True)


def tensor_maps(c: ModelConfig) -> Maps:
    """Every parameter of a GPT-2 model in `transformer.*` tensors."""
    d, h, hd = c.d_model, c.n_heads, c.head_dim
    p = "transformer.h.{i}"
    maps = {("transformer/embed", "embeddings"): layout.identity("transformer.wte.weight",
                                                                 (c.vocab_size, d), False),
            ("transformer/pos_embed", "embeddings"): layout.identity("transformer.wpe.weight",
                                                                     (c.max_positions, d), False)}
    layout.norms(maps, c, p, [("ln_1", "ln_1"), ("ln_2", "ln_2")])
    for j, ours in enumerate("qkv"):  # c_attn: Conv1D [d, 3 * d], columns q | k | v
        maps[(f"transformer/layers/attn/{ours}", "w")] = TensorMap(
            f"{p}.attn.c_attn.weight", ((d,), (3, h, hd)), (0, 2, 3), ((1, j),))
        maps[(f"transformer/layers/attn/{ours}", "b")] = TensorMap(
            f"{p}.attn.c_attn.bias", ((3, h, hd),), (1, 2), ((0, j),))
    maps[("transformer/layers/attn/o", "w")] = TensorMap(f"{p}.attn.c_proj.weight",
                                                         ((h, hd), (d,)), (0, 1, 2))
    maps[("transformer/layers/attn/o", "b")] = layout.identity(f"{p}.attn.c_proj.bias", (d,))
    layout.mlp(maps, c, p, [("fc_in", "mlp.c_fc"), ("fc_out", "mlp.c_proj")], conv1d=True)
    layout.final_norm_and_head(maps, c, "transformer.ln_f")
    return maps


FAMILY = Family(model_type="gpt2", hf_class="GPT2LMHeadModel", base_prefix="transformer.",
                config_fields=config_fields, hf_fields=hf_fields, tensor_maps=tensor_maps)
