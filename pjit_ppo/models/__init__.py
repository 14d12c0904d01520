"""Models: one Haiku decoder for GPT-J / GPT-2 / GPT-NeoX / Llama, scalar heads, HF I/O.

The names users import are re-exported here; the modules behind them may move. They load
on first use, so a submodule that needs no jax (`pjit_ppo.models.config`, the families'
layouts) imports without starting it: a launch refused on its model's config.json then
exits before paying for the jax import.
"""
import importlib

#: public name -> module that defines it (the name is the module itself where they match).
_EXPORTS = {
    "heads": "pjit_ppo.models.heads",
    "SUPPORTED_ARCHITECTURES": "pjit_ppo.models.config",
    "ModelConfig": "pjit_ppo.models.config",
    "ModelConfigError": "pjit_ppo.models.config",
    "load_pretrained": "pjit_ppo.models.hf",
    "save_pretrained": "pjit_ppo.models.hf",
    "head_token_logprobs": "pjit_ppo.models.token_logprobs",
    **{name: "pjit_ppo.models.transformer" for name in (
        "KVCache", "PrefixKVCache", "forward", "hidden_states", "init_kv_cache", "init_params",
        "lm_head_logits", "lm_head_weights", "lm_logits", "param_shapes")},
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        value = module if module.__name__.endswith("." + name) else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pjit_ppo.models' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
