"""Tiny random HF checkpoints of each supported family, made with transformers + torch.

Only tests use this (the library never imports torch).
"""
import torch
import transformers

FAMILIES = ("gpt2", "gptj", "gpt_neox", "llama")
# Named test variants: name -> (family, config overrides).
VARIANTS = {
    "gpt2": ("gpt2", {}),
    "gptj": ("gptj", {}),
    "gpt_neox": ("gpt_neox", {}),
    "llama": ("llama", {}),
    "gpt_neox_sequential": ("gpt_neox", {"use_parallel_residual": False}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
}
VOCAB = 96
PAD_ID = VOCAB - 1


def hf_config(family: str, **overrides):
    """A small transformers config of `family` (d_model 32, 2 layers, 4 heads)."""
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=PAD_ID)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    elif family == "gptj":
        cfg = transformers.GPTJConfig(n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, **common)
    elif family == "gpt_neox":
        cfg = transformers.GPTNeoXConfig(hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=64,
                                         max_position_embeddings=64, rotary_pct=0.5,
                                         use_parallel_residual=True, **common)
    elif family == "llama":
        cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=64, max_position_embeddings=64,
                                       rms_norm_eps=1e-5, **common)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_model(family: str, seed: int = 0, **overrides):
    """A random-weight transformers causal LM in eval mode, float32.

    Weights are drawn with a larger std than HF's default (0.02) so that
    differences in the implementation show up in the logits, and biases and norm
    parameters are randomised too.
    """
    torch.manual_seed(seed)
    cfg = hf_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() >= 2:
                p.normal_(0.0, 0.2)
            elif "norm" in name or "ln" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p)) if name.endswith("weight") else \
                    p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
    return model


def save_model(family: str, path: str, seed: int = 0, **overrides):
    """Saves a tiny random model of `family` to `path` (config.json + safetensors)."""
    model = make_model(family, seed, **overrides)
    model.save_pretrained(path)
    return model
