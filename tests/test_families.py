"""The family registry: each entry's config.json mapping round-trips, its tensor maps cover
exactly our parameters and name exactly transformers' tensors, unknown families are named."""
import math

import pytest
import transformers

import tiny_hf
from pjit_ppo.models import SUPPORTED_ARCHITECTURES, ModelConfig, ModelConfigError, hf_layout
from pjit_ppo.models import families, param_shapes
from pjit_ppo.models.families.layout import TensorMap

# tiny_hf's variants plus config.json switches they leave at their defaults.
CONFIGS = dict(tiny_hf.VARIANTS,
               llama_head_dim=("llama", {"head_dim": 16, "rope_theta": 5e5}),
               gpt_neox_no_bias=("gpt_neox", {"attention_bias": False}),
               gpt2_n_inner=("gpt2", {"n_inner": 48, "activation_function": "relu"}))


def _hf_config(name):
    family, overrides = CONFIGS[name]
    return tiny_hf.hf_config(family, **overrides)


def test_registry_is_keyed_by_model_type():
    assert SUPPORTED_ARCHITECTURES == tuple(families.REGISTRY)
    assert set(families.REGISTRY) == set(tiny_hf.FAMILIES)
    for model_type, family in families.REGISTRY.items():
        assert family.model_type == model_type
        assert families.get(model_type) is family
        assert getattr(transformers, family.hf_class)  # a real transformers class


@pytest.mark.parametrize("model_type", [None, "bert", "GPT2"])
def test_unknown_model_type_names_the_supported_ones(model_type):
    for call in (lambda: families.get(model_type),
                 lambda: ModelConfig.from_hf_dict({"model_type": model_type})):
        with pytest.raises(ModelConfigError) as e:
            call()
        assert repr(model_type) in str(e.value) or "no `model_type`" in str(e.value)
        assert ", ".join(SUPPORTED_ARCHITECTURES) in str(e.value)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_round_trip(name):
    """config.json -> ModelConfig -> config.json (hand-built path) -> the same ModelConfig,
    and transformers reads the written dict as the same architecture."""
    config = ModelConfig.from_hf_dict(_hf_config(name).to_dict())
    family = families.get(config.architecture)
    written = config.replace(hf_config=None).to_hf_dict()
    assert written["model_type"] == family.model_type
    assert written["architectures"] == [family.hf_class]
    assert ModelConfig.from_hf_dict(written) == config
    theirs = transformers.AutoConfig.for_model(**written).to_dict()
    assert ModelConfig.from_hf_dict(theirs) == config


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tensor_maps_cover_every_parameter(name):
    """One TensorMap per parameter of `param_shapes`, of that parameter's shape."""
    config = ModelConfig.from_hf_dict(_hf_config(name).to_dict())
    maps = families.get(config.architecture).tensor_maps(config)
    shapes = param_shapes(config)
    assert set(maps) == {(m, p) for m, leaves in shapes.items() for p in leaves}
    for (module, pname), m in maps.items():
        want = ((config.n_layers,) if m.layered else ()) + m.our_shape
        assert tuple(shapes[module][pname].shape) == want, (module, pname)
        # Our array holds exactly the HF tensor's elements not fixed by `select`.
        fixed = math.prod(m.sub_sizes[s] for s, _ in m.select)
        assert math.prod(m.our_shape) * fixed == math.prod(m.hf_shape), (module, pname)
    assert hf_layout.tensor_maps(config) == maps


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tensor_maps_name_transformers_parameters(name):
    """Each mapped HF name (or an alias) is a parameter of transformers' model of that shape,
    and every transformers parameter is mapped."""
    hf_config = _hf_config(name)
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    family = families.get(config.architecture)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
    seen = set()
    for m in family.tensor_maps(config).values():
        for layer in (range(config.n_layers) if m.layered else [None]):
            found = [n for n in family.candidate_names(m.name(layer)) if n in theirs]
            assert len(found) == 1, (m.name(layer), found)
            assert theirs[found[0]] == m.hf_shape, found[0]
            seen.add(found[0])
    assert seen == set(theirs)


def test_hf_layout_over_the_registry():
    assert hf_layout.TensorMap is TensorMap
    assert list(hf_layout.candidate_names("gpt2", "transformer.h.0.ln_1.weight")) == [
        "transformer.h.0.ln_1.weight", "h.0.ln_1.weight"]
    assert list(hf_layout.candidate_names("gpt_neox", "embed_out.weight")) == [
        "embed_out.weight", "lm_head.weight"]
    assert list(hf_layout.candidate_names("llama", "lm_head.weight")) == ["lm_head.weight"]
