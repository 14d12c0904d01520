"""LoRA adapters (pjit_ppo/models/lora.py): the adapted forward against a forward on
merged weights, rank 0 as today's model, the adapter tree's shapes, shardings and
initial value, dropout only where a training step asks for it, the base fingerprint,
and the config section."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjit_ppo import sampling, sharding
from pjit_ppo.config import LoraOptions, ModelOptions, RunConfig, resume_conflicts
from pjit_ppo.errors import ConfigError
from pjit_ppo.models import forward, init_params, lora, param_shapes
from pjit_ppo.models.config import ModelConfig
import tiny_hf

ALL = (r"attn/(q|k|v|o)/w$", r"mlp/fc_(in|gate|out)/w$")


def _config(variant):
    family, overrides = tiny_hf.VARIANTS[variant]
    return ModelConfig.from_hf_dict(tiny_hf.hf_config(family, **overrides).to_dict())


def _inputs(batch=3, length=9):
    ids = jax.random.randint(jax.random.PRNGKey(2), (batch, length), 0, tiny_hf.VOCAB - 1)
    mask = jnp.arange(length)[None] >= jnp.array([[0], [2], [4]])[:batch]
    return ids, mask


def _trained_adapters(config, seed=1):
    """Adapters as after some training: lora_b non-zero."""
    adapters = lora.init_adapters(config, jax.random.PRNGKey(seed))
    return jax.tree.map(lambda x: x + 0.2 * jax.random.normal(jax.random.PRNGKey(seed + 1),
                                                              x.shape), adapters)


@pytest.mark.parametrize("variant,targets", [("llama_bias", ALL), ("gpt2", ALL),
                                             ("gptj", (r"attn/(q|v)/w$",)),
                                             ("gpt_neox", (r"attn/o/w$", r"fc_out/w$"))])
def test_adapter_forward_equals_merged_forward(variant, targets):
    base_cfg = _config(variant)
    spec = lora.LoraSpec(rank=4, alpha=8.0, targets=targets)
    cfg = lora.with_adapters(base_cfg, spec)
    base = init_params(base_cfg, jax.random.PRNGKey(0))
    adapters = _trained_adapters(cfg)
    ids, mask = _inputs()

    @jax.jit
    def both(base, adapters):
        adapted = forward(cfg, lora.attach(base, adapters), ids, mask)[1]
        merged = forward(base_cfg, lora.merge(spec, base, adapters), ids, mask)[1]
        plain = forward(base_cfg, base, ids, mask)[1]
        return adapted, merged, plain

    adapted, merged, plain = both(base, adapters)
    scale = float(jnp.max(jnp.abs(merged)))
    # fp32: x@W + s*(x@A)@B and x@(W + s*A@B) differ by summation order (1e-5 relative
    # on some CPUs), three orders of magnitude below what the adapters change.
    assert float(jnp.max(jnp.abs(adapted - merged))) <= 5e-5 * scale
    assert float(jnp.max(jnp.abs(adapted - plain))) > 1e-2 * scale  # the adapters matter


def test_adapter_sampling_equals_merged_sampling():
    # The KV-cache decode path (per-layer buffers, shared prompt prefix) reads the
    # adapters too: greedy tokens and log-probs as with merged weights.
    base_cfg = _config("llama")
    spec = lora.LoraSpec(rank=2, alpha=4.0, targets=ALL)
    cfg = lora.with_adapters(base_cfg, spec)
    base = init_params(base_cfg, jax.random.PRNGKey(0))
    adapters = _trained_adapters(cfg)
    ids, mask = _inputs(batch=2, length=6)

    @jax.jit
    def both(base, adapters):
        key = jax.random.PRNGKey(3)
        a = sampling.generate(cfg, lora.attach(base, adapters), ids, mask, key,
                              max_new_tokens=5, samples_per_prompt=1)
        m = sampling.generate(base_cfg, lora.merge(spec, base, adapters), ids, mask, key,
                              max_new_tokens=5, samples_per_prompt=1)
        return a, m

    (tokens_a, logp_a), (tokens_m, logp_m) = both(base, adapters)
    np.testing.assert_array_equal(tokens_a, tokens_m)
    np.testing.assert_allclose(logp_a, logp_m, atol=1e-5)


def test_rank_zero_is_todays_model():
    assert lora.spec_from_options(LoraOptions()) is None
    assert not ModelOptions().lora.enabled
    cfg = _config("gpt2")
    assert lora.with_adapters(cfg, None) is cfg and lora.without_adapters(cfg) is cfg
    assert cfg.lora is None and lora.adapted_modules(cfg) == ()
    shapes = param_shapes(cfg)
    assert not any(lora.is_adapter(n) for leaves in shapes.values() for n in leaves)
    # The options' defaults build no spec; a ModelConfig without one hashes as before.
    assert hash(cfg) == hash(cfg.replace(lora=None))


def test_adapter_tree_shapes_init_and_base_equality():
    base_cfg = _config("llama")
    cfg = lora.with_adapters(base_cfg, lora.LoraSpec(rank=3, alpha=6.0, targets=ALL))
    # The tree Haiku creates for the adapted model = base tree + adapter_shapes.
    full = param_shapes(cfg)
    assert lora.base_of(full).keys() == param_shapes(base_cfg).keys()
    assert jax.tree.map(lambda x: x.shape, lora.adapters_of(full)) == jax.tree.map(
        lambda x: x.shape, lora.adapter_shapes(cfg))
    assert set(lora.adapter_shapes(cfg)) == {f"transformer/layers/{m}" for m in lora.PROJECTIONS}
    q = lora.adapter_shapes(cfg)["transformer/layers/attn/q"]
    assert q["lora_a"].shape == (2, 32, 3) and q["lora_b"].shape == (2, 3, 4, 8)
    o = lora.adapter_shapes(cfg)["transformer/layers/attn/o"]
    assert o["lora_a"].shape == (2, 4, 8, 3) and o["lora_b"].shape == (2, 3, 32)
    # Fresh adapters: lora_b = 0, so the adapted model is the base model.
    adapters = lora.init_adapters(cfg, jax.random.PRNGKey(0))
    assert all(float(jnp.abs(m["lora_b"]).max()) == 0 for m in adapters.values())
    base = init_params(base_cfg, jax.random.PRNGKey(0))
    ids, mask = _inputs()
    np.testing.assert_array_equal(forward(cfg, lora.attach(base, adapters), ids, mask)[1],
                                  forward(base_cfg, base, ids, mask)[1])


def test_targets_that_miss_the_model_are_refused():
    with pytest.raises(ConfigError, match="matches no projection"):
        lora.with_adapters(_config("gpt2"), lora.LoraSpec(2, 2.0, (r"fc_gate/w$",)))


def test_adapters_shard_like_their_base_weight():
    cfg = lora.with_adapters(_config("llama"), lora.LoraSpec(rank=2, alpha=2.0, targets=ALL))
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    specs = sharding.param_specs(lora.adapter_shapes(cfg), mesh)
    base_specs = sharding.param_specs(param_shapes(lora.without_adapters(cfg)), mesh)
    for module, leaves in specs.items():
        w = tuple(base_specs[module]["w"])
        ins = leaves["lora_a"].__len__() - 2  # [layers, *in, rank]
        assert tuple(leaves["lora_a"]) == w[:1 + ins] + (None,), module
        assert tuple(leaves["lora_b"]) == w[:1] + (None,) + w[1 + ins:], module
    adapters = jax.jit(lambda k: lora.init_adapters(cfg, k),
                       out_shardings=sharding.param_shardings(lora.adapter_shapes(cfg), mesh))(
        jax.random.PRNGKey(0))
    assert adapters["transformer/layers/mlp/fc_in"]["lora_a"].sharding.spec[1] == "fsdp"


def test_dropout_only_with_a_training_key():
    base_cfg = _config("gpt2")
    spec = lora.LoraSpec(rank=4, alpha=8.0, targets=ALL, dropout=0.5)
    cfg = lora.with_adapters(base_cfg, spec)
    plain_cfg = lora.with_adapters(base_cfg, lora.LoraSpec(rank=4, alpha=8.0, targets=ALL))
    base, adapters = init_params(base_cfg, jax.random.PRNGKey(0)), _trained_adapters(cfg)
    ids, mask = _inputs()
    no_key = forward(cfg, lora.attach(base, adapters), ids, mask)[1]
    reference = forward(plain_cfg, lora.attach(base, adapters), ids, mask)[1]
    np.testing.assert_array_equal(no_key, reference)
    keyed = [forward(cfg, lora.attach(base, adapters, jax.random.PRNGKey(k)), ids, mask)[1]
             for k in (7, 7, 8)]
    np.testing.assert_array_equal(keyed[0], keyed[1])  # a function of the key
    assert float(jnp.abs(keyed[0] - keyed[2]).max()) > 0
    assert float(jnp.abs(keyed[0] - reference).max()) > 0


def test_fingerprint_is_mesh_independent_and_value_sensitive():
    cfg = _config("gptj")
    params = init_params(cfg, jax.random.PRNGKey(0))
    one = lora.fingerprint(params)
    for mesh in (sharding.make_mesh(fsdp=8), sharding.make_mesh(fsdp=2, tensor=4)):
        placed = jax.device_put(params, sharding.param_shardings(params, mesh))
        assert lora.fingerprint(placed) == one
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert lora.fingerprint(bf16) != one
    changed = jax.tree.map(lambda x: x, params)
    w = changed["transformer/layers/attn/q"]["w"]
    changed["transformer/layers/attn/q"]["w"] = w.at[1, 3, 0, 0].add(1e-3)
    assert lora.fingerprint(changed) != one


def test_config_round_trip_and_resume_refuses_lora_changes():
    config = RunConfig()
    config.model.lora = LoraOptions(rank=8, alpha=16.0, dropout=0.1)
    tree = config.to_dict()
    back = RunConfig.from_dict(resume_json(tree))
    assert back.model.lora == config.model.lora
    for field, value in (("rank", 4), ("alpha", 8.0), ("targets", (r"attn/q/w$",)),
                         ("dropout", 0.0)):
        other = RunConfig.from_dict(resume_json(tree))
        setattr(other.model.lora, field, value)
        conflicts = resume_conflicts(resume_json(tree), other.to_dict())
        assert list(conflicts) == [f"model.lora.{field}"], conflicts
    # A checkpoint written before model.lora existed resumes at the default (rank 0).
    old = resume_json(RunConfig().to_dict())
    del old["model"]["lora"]
    assert resume_conflicts(old, RunConfig().to_dict()) == {}
    lora_now = RunConfig()
    lora_now.model.lora.rank = 2
    assert "model.lora.rank" in resume_conflicts(old, lora_now.to_dict())


def resume_json(tree):
    import json
    return json.loads(json.dumps(tree))


@pytest.mark.parametrize("options,fragment", [
    (dict(rank=-1), "model.lora.rank=-1 must be an integer >= 0"),
    (dict(rank=2, alpha=0.0), "model.lora.alpha=0.0 must be > 0"),
    (dict(rank=2, dropout=1.0), "model.lora.dropout=1.0 must be a number in [0, 1)"),
    (dict(rank=2, targets=("lm_head/w$",)), "matches none of the weights LoRA can adapt"),
    (dict(rank=2, targets=("(",)), "is not a regular expression"),
    (dict(rank=2, targets=()), "model.lora.targets is empty"),
])
def test_lora_options_are_checked(options, fragment):
    with pytest.raises(ConfigError) as e:
        LoraOptions(**options).validate()
    assert fragment in str(e.value)


def test_fingerprint_of_a_cast_equals_the_cast_copys():
    params = init_params(_config("llama"), jax.random.PRNGKey(0))
    copy = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    assert lora.fingerprint(params, "bfloat16") == lora.fingerprint(copy)
    assert lora.fingerprint(params, "float32") == lora.fingerprint(params)


def test_peft_export_refuses_a_projection_inside_a_fused_tensor(tmp_path):
    from pjit_ppo.models import peft_export
    cfg = lora.with_adapters(_config("gpt2"), lora.LoraSpec(rank=2, alpha=2.0, targets=ALL))
    adapters = jax.device_get(lora.init_adapters(cfg, jax.random.PRNGKey(0)))
    with pytest.raises(ConfigError, match=r"attn/[qkv] is part of the fused HF tensor "
                                          r"transformer.h.N.attn.c_attn.weight"):
        peft_export.save_peft_adapters(str(tmp_path / "a"), cfg, adapters)
    # GPT-2's attention output and MLP are Conv1D modules of their own: PEFT's
    # fan_in_fan_out layout.
    cfg = lora.with_adapters(_config("gpt2"),
                             lora.LoraSpec(rank=2, alpha=2.0, targets=(r"attn/o/w$", r"mlp/")))
    adapters = jax.device_get(lora.init_adapters(cfg, jax.random.PRNGKey(0)))
    peft_export.save_peft_adapters(str(tmp_path / "b"), cfg, adapters)
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True and config["r"] == 2
