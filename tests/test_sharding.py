"""Mesh construction, partition rules, sharded init and optimizer-state placement."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from pjit_ppo import sharding
from pjit_ppo.models import ModelConfig, init_params, lm_logits, param_shapes
from pjit_ppo.optim import TfAdamState, make_optimizer

LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
             max_position_embeddings=64)


def test_make_mesh_axes_and_errors():
    mesh = sharding.make_mesh(data=2, fsdp=-1, tensor=2)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(sharding.ShardingError, match="at most one mesh axis may be -1"):
        sharding.make_mesh(data=-1, fsdp=-1)
    with pytest.raises(sharding.ShardingError, match="needs 12 devices but 8"):
        sharding.make_mesh(data=3, fsdp=4, tensor=1)
    with pytest.raises(sharding.ShardingError, match="not divisible"):
        sharding.make_mesh(data=3, fsdp=-1)


def test_each_device_holds_only_its_slice():
    config = ModelConfig.from_hf_dict(LLAMA)
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    params = sharding.init_sharded(functools.partial(init_params, config), mesh,
                                   jax.random.PRNGKey(0))
    full = jax.jit(functools.partial(init_params, config))(jax.random.PRNGKey(0))
    q = params["transformer/layers/attn/q"]["w"]  # [L, d_model, heads, head_dim]
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    q_full = np.asarray(full["transformer/layers/attn/q"]["w"])
    for shard in q.addressable_shards:
        assert shard.data.shape == (2, 32 // 4, 4 // 2, 8)
        np.testing.assert_array_equal(np.asarray(shard.data), q_full[shard.index])
    # Sharded params compute the same logits as unsharded ones.
    ids = jnp.arange(12).reshape(2, 6) % 128
    mask = jnp.ones((2, 6), bool)
    np.testing.assert_allclose(jax.jit(functools.partial(lm_logits, config))(params, ids, mask),
                               lm_logits(config, full, ids, mask), atol=1e-5)


def test_switching_fsdp_and_tensor_is_an_axis_rule_change():
    config = ModelConfig.from_hf_dict(LLAMA)
    shapes = param_shapes(config)
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    fsdp_only = dict(sharding.DEFAULT_AXIS_RULES, heads=None, kv_heads=None, mlp=None,
                     vocab=None)
    specs = sharding.param_specs(shapes, mesh, axis_rules=fsdp_only)
    assert specs["transformer/layers/mlp/fc_in"]["w"] == P(None, "fsdp", None)
    specs = sharding.param_specs(shapes, mesh)
    assert specs["transformer/layers/mlp/fc_in"]["w"] == P(None, "fsdp", "tensor")


def test_unmatched_parameter_is_an_error_naming_it():
    config = ModelConfig.from_hf_dict(LLAMA)
    shapes = dict(param_shapes(config))
    shapes["my_adapter"] = {"w": jax.ShapeDtypeStruct((32, 4), jnp.float32)}
    mesh = sharding.make_mesh(fsdp=-1)
    with pytest.raises(sharding.ShardingError, match="no partition rule matches parameter "
                                                     "'my_adapter/w'"):
        sharding.param_specs(shapes, mesh)


def test_indivisible_dimension_names_parameter_dimension_and_mesh():
    config = ModelConfig.from_hf_dict(dict(LLAMA, num_attention_heads=2, num_key_value_heads=1,
                                           hidden_size=32))
    mesh = sharding.make_mesh(fsdp=2, tensor=4)
    with pytest.raises(sharding.ShardingError) as err:
        sharding.param_specs(param_shapes(config), mesh)
    msg = str(err.value)
    assert "transformer/layers/attn" in msg and ("'heads'" in msg or "'kv_heads'" in msg)
    assert "size 4" in msg and "'tensor': 4" in msg


@pytest.mark.parametrize("kind", ["tf_adam", "adam"])
def test_optimizer_state_follows_its_parameter(kind):
    """Adam's moments get exactly their parameter's sharding; counts and the learning
    rate are replicated."""
    config = ModelConfig.from_hf_dict(LLAMA)
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    params = sharding.init_sharded(functools.partial(init_params, config), mesh,
                                   jax.random.PRNGKey(0))
    opt = make_optimizer(learning_rate=1e-3, num_updates=10, kind=kind, max_grad_norm=1.0)
    param_sh = jax.tree_util.tree_map(lambda x: x.sharding, params)
    opt_sh = sharding.opt_state_shardings(opt, param_sh, jax.eval_shape(opt.init, params), mesh)
    state = jax.jit(opt.init, out_shardings=opt_sh)(params)

    adam_types = (TfAdamState, optax.ScaleByAdamState)
    adams = [x for x in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(
        x, adam_types)) if isinstance(x, adam_types)]
    assert len(adams) == 1
    adam = adams[0]
    param_paths = _leaf_paths(params)
    for name, moments in (("mu", adam.mu), ("nu", adam.nu)):
        assert _leaf_paths(moments) == param_paths, name
        for path, moment, param in zip(param_paths, jax.tree_util.tree_leaves(moments),
                                       jax.tree_util.tree_leaves(params)):
            assert moment.sharding == param.sharding, (name, path)
            assert moment.addressable_shards[0].data.shape == \
                param.addressable_shards[0].data.shape, (name, path)
    # A parameter that is split over both mesh axes keeps that split in its moments.
    q_spec = P(None, "fsdp", "tensor", None)
    assert params["transformer/layers/attn/q"]["w"].sharding.spec == q_spec
    assert adam.mu["transformer/layers/attn/q"]["w"].sharding.spec == q_spec
    assert adam.nu["transformer/layers/attn/q"]["w"].sharding.spec == q_spec

    # Everything that is not a moment (step counts, the learning rate) is a replicated scalar.
    moment_ids = {id(x) for x in jax.tree_util.tree_leaves((adam.mu, adam.nu))}
    others = [x for x in jax.tree_util.tree_leaves(state) if id(x) not in moment_ids]
    assert any(x is adam.count for x in others)
    assert any(x is state.hyperparams["learning_rate"] for x in others)
    assert all(x.ndim == 0 and x.sharding.is_fully_replicated for x in others)


def _leaf_paths(tree):
    return [jax.tree_util.keystr(path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
