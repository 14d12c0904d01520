"""HF checkpoint import/export: round trips through transformers, sharded import,
index-format checkpoints, half-precision files, clear errors, host memory."""
import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import tiny_hf
from pjit_ppo import sharding
from pjit_ppo.models import ModelConfigError, load_pretrained, save_pretrained
from pjit_ppo.models.safetensors_io import (INDEX_FILE, SINGLE_FILE, CheckpointError,
                                            read_header, write_safetensors)

VARIANTS = tiny_hf.VARIANTS


def _mesh():
    return sharding.make_mesh(fsdp=4, tensor=2)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits.float().numpy()


def _ids():
    return np.random.RandomState(0).randint(0, tiny_hf.VOCAB, (2, 7))


def _assert_same_params(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def _load_transformers(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path,
                                                                    output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"transformers could not load every weight: {problems}"
    return model.eval()


# ------------------------------------------------------------------ export
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip(tiny, variant, tmp_path):
    """Sharded import -> save_pretrained -> transformers loads it exactly; re-import is equal."""
    path, model = tiny(variant)
    config, params = load_pretrained(path, mesh=_mesh())
    out = str(tmp_path / "export")
    files = save_pretrained(out, config, params)
    assert files == [SINGLE_FILE]

    # Same tensor names and values as transformers' own save.
    ours = safetensors.numpy.load_file(os.path.join(out, SINGLE_FILE))
    theirs = safetensors.numpy.load_file(os.path.join(path, SINGLE_FILE))
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)

    exported = _load_transformers(out)
    np.testing.assert_allclose(_logits(exported, _ids()), _logits(model, _ids()), atol=1e-6)
    _, again = load_pretrained(out)
    _assert_same_params(again, params)


def test_export_bfloat16(tiny, tmp_path):
    path, model = tiny("gpt_neox")
    config, params = load_pretrained(path)
    out = str(tmp_path / "bf16")
    save_pretrained(out, config, params, dtype="bfloat16")
    assert {t.dtype for t in read_header(os.path.join(out, SINGLE_FILE)).values()} == {"BF16"}
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    exported = _load_transformers(out)
    assert exported.dtype == torch.bfloat16
    _, again = load_pretrained(out, dtype="bfloat16")
    want = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16), params)
    _assert_same_params(again, want)


def test_export_sharded_files_and_reexport(tiny, tmp_path):
    """Small max_shard_size -> several files + index; transformers loads them. Re-exporting
    as one file into the same directory removes the old shards."""
    path, model = tiny("llama")
    config, params = load_pretrained(path, mesh=_mesh())
    out = str(tmp_path / "sharded")
    files = save_pretrained(out, config, params, max_shard_size="20KB")
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    with open(os.path.join(out, INDEX_FILE)) as f:
        index = json.load(f)
    assert sorted(set(index["weight_map"].values())) == files
    for file in files:  # every file respects the limit unless it holds one big tensor
        header = read_header(os.path.join(out, file))
        size = os.path.getsize(os.path.join(out, file))
        assert size <= 20_000 + 4096 or len(header) == 1
    np.testing.assert_allclose(_logits(_load_transformers(out), _ids()), _logits(model, _ids()),
                               atol=1e-6)
    _, again = load_pretrained(out)
    _assert_same_params(again, params)

    assert save_pretrained(out, config, params) == [SINGLE_FILE]
    assert sorted(n for n in os.listdir(out) if "safetensors" in n) == [SINGLE_FILE]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_hand_built_config(variant, tmp_path):
    """A model never imported from HF (random init, config.json written by ModelConfig)
    loads in transformers and gives our logits."""
    from pjit_ppo.models import ModelConfig, lm_logits, param_shapes
    family, overrides = VARIANTS[variant]
    hf = tiny_hf.hf_config(family, **overrides).to_dict()
    config = ModelConfig.from_hf_dict(hf).replace(hf_config=None)
    # Random host (numpy) params, biases and norms included, so a dropped one would show.
    rng = np.random.RandomState(2)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: ((1.0 if "scale" in str(path) else 0.0)
                         + 0.2 * rng.standard_normal(x.shape)).astype(np.float32),
        param_shapes(config))
    save_pretrained(str(tmp_path), config, params)
    model = _load_transformers(str(tmp_path))
    ours = np.asarray(jax.jit(functools.partial(lm_logits, config))(
        params, jnp.asarray(_ids()), jnp.ones(_ids().shape, bool)))
    assert np.abs(ours - _logits(model, _ids())).max() <= 1e-4


def test_import_base_model_names(tiny, tmp_path):
    """Checkpoints of the bare base model (the Hub's original `gpt2`: `h.0.attn...`,
    `wte.weight`, no `transformer.` prefix) import like the *LMHeadModel ones."""
    path, _ = tiny("gpt2")
    tensors = safetensors.numpy.load_file(os.path.join(path, SINGLE_FILE))
    bare = _copy(path, str(tmp_path / "bare"), ["config.json"])
    safetensors.numpy.save_file({k.removeprefix("transformer."): v for k, v in tensors.items()},
                                os.path.join(bare, SINGLE_FILE), metadata={"format": "pt"})
    _assert_same_params(load_pretrained(bare)[1], load_pretrained(path)[1])


# ------------------------------------------------------------------ import
@pytest.mark.parametrize("variant", ["gpt2", "gptj", "gpt_neox", "llama"])
def test_sharded_import_slices(tiny, variant):
    """On the 4x2 mesh every device holds exactly its slice of the full parameter."""
    path, _ = tiny(variant)
    config, full = load_pretrained(path)
    mesh = _mesh()
    # Second variant of the rules also shards the stacked layers axis (per-layer reads).
    layer_rules = dict(sharding.DEFAULT_AXIS_RULES, layers="tensor", heads=None, kv_heads=None,
                       mlp=None, vocab=None)
    for axis_rules in (sharding.DEFAULT_AXIS_RULES, layer_rules):
        _, params = load_pretrained(path, mesh=mesh, axis_rules=axis_rules)
        for (path_, x), ref in zip(jax.tree_util.tree_leaves_with_path(params),
                                   jax.tree_util.tree_leaves(full)):
            ref = np.asarray(ref)
            assert len(x.addressable_shards) == 8
            for shard in x.addressable_shards:
                assert shard.data.shape == x.sharding.shard_shape(x.shape), path_
                np.testing.assert_array_equal(np.asarray(shard.data), ref[shard.index],
                                              err_msg=str(path_))
    # Spot-check the layout: q is split over embed (fsdp=4) and heads (tensor=2).
    q = load_pretrained(path, mesh=mesh)[1]["transformer/layers/attn/q"]["w"]
    L, d, h, hd = q.shape
    assert q.addressable_shards[0].data.shape == (L, d // 4, h // 2, hd)


def test_import_index_format_from_transformers(tiny, tmp_path):
    """transformers' own sharded save (index + several files) imports like the single file."""
    path, model = tiny("gpt_neox")
    sharded = str(tmp_path / "hf_sharded")
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert os.path.exists(os.path.join(sharded, INDEX_FILE))
    assert len([n for n in os.listdir(sharded) if n.endswith(".safetensors")]) > 1
    _, a = load_pretrained(sharded, mesh=_mesh())
    _, b = load_pretrained(path)
    _assert_same_params(a, b)


@pytest.mark.parametrize("torch_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_import_half_precision_checkpoint(tmp_path, torch_dtype):
    model = tiny_hf.make_model("llama").to(torch_dtype)
    model.save_pretrained(str(tmp_path))
    code = {torch.bfloat16: "BF16", torch.float16: "F16"}[torch_dtype]
    assert read_header(str(tmp_path / SINGLE_FILE))["model.norm.weight"].dtype == code

    config, params = load_pretrained(str(tmp_path), mesh=_mesh())  # fp32 storage
    w = params["transformer/layers/attn/k"]["w"]
    assert w.dtype == np.float32
    want = model.model.layers[1].self_attn.k_proj.weight.detach().float().numpy().T.reshape(
        config.d_model, config.n_kv_heads, config.head_dim)
    np.testing.assert_array_equal(np.asarray(w)[1], want)

    from pjit_ppo.models import lm_logits
    # Reference: the saved half-precision weights upcast on load (not model.float(), whose
    # rotary inv_freq buffer would keep its half-precision rounding).
    ref = _logits(transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32).eval(), _ids())
    ours = np.asarray(jax.jit(lambda p, i: lm_logits(config, p, i, jnp.ones_like(i, bool)))(
        params, _ids()))
    assert np.abs(ours - ref).max() <= 1e-4

    half = "bfloat16" if torch_dtype == torch.bfloat16 else "float16"
    _, stored = load_pretrained(str(tmp_path), dtype=half)
    assert stored["transformer/embed"]["embeddings"].dtype == np.dtype(half if half == "float16"
                                                                       else ml_dtypes.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(stored["transformer/layers/attn/k"]["w"]).astype(np.float32), np.asarray(w))


# ------------------------------------------------------------------ errors
def _copy(src, dst, files):
    os.makedirs(dst)
    for name in files:
        shutil.copy(os.path.join(src, name), dst)
    return dst


def test_error_missing_files(tiny, tmp_path):
    path, _ = tiny("gpt2")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_pretrained(str(tmp_path / "nowhere"))
    no_config = _copy(path, str(tmp_path / "no_config"), [SINGLE_FILE])
    with pytest.raises(FileNotFoundError, match=r"config\.json.*no_config|no_config.*config\.json"):
        load_pretrained(no_config)
    no_weights = _copy(path, str(tmp_path / "no_weights"), ["config.json"])
    with pytest.raises(FileNotFoundError) as e:
        load_pretrained(no_weights)
    assert "no_weights" in str(e.value) and SINGLE_FILE in str(e.value) \
        and INDEX_FILE in str(e.value)


def _edit_config(src, dst, **changes):
    dst = _copy(src, dst, [SINGLE_FILE, "config.json"])
    with open(os.path.join(dst, "config.json")) as f:
        hf = json.load(f)
    hf.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf, f)
    return dst


def test_error_unsupported_model_type(tiny, tmp_path):
    path, _ = tiny("gpt2")
    bad = _edit_config(path, str(tmp_path / "bert"), model_type="bert")
    with pytest.raises(ModelConfigError, match="'bert'.*gptj, gpt2, gpt_neox, llama"):
        load_pretrained(bad)


def test_error_shape_mismatch(tiny, tmp_path):
    path, _ = tiny("gpt2")
    bad = _edit_config(path, str(tmp_path / "vocab"), vocab_size=100)
    with pytest.raises(CheckpointError,
                       match=r"transformer\.wte\.weight.*\(96, 32\).*\(100, 32\)"):
        load_pretrained(bad)


def test_error_missing_tensor_and_bad_dtype(tiny, tmp_path):
    path, _ = tiny("llama")
    tensors = safetensors.numpy.load_file(os.path.join(path, SINGLE_FILE))
    missing = _copy(path, str(tmp_path / "missing"), ["config.json"])
    safetensors.numpy.save_file({k: v for k, v in tensors.items()
                                 if k != "model.layers.1.mlp.up_proj.weight"},
                                os.path.join(missing, SINGLE_FILE), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_pretrained(missing)

    bad_dtype = _copy(path, str(tmp_path / "int"), ["config.json"])
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    safetensors.numpy.save_file(tensors, os.path.join(bad_dtype, SINGLE_FILE),
                                metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*I32"):
        load_pretrained(bad_dtype)
    with pytest.raises(ValueError, match="dtype"):
        load_pretrained(path, dtype="int8")


# ------------------------------------------------------------------ host memory
# A GPT-2-layout checkpoint of ~330 MB (fp32): d_model 768, 8 layers, vocab 32000.
_BIG = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=32000, n_embd=768,
            n_layer=8, n_head=12, n_positions=1024, n_inner=None, layer_norm_epsilon=1e-5,
            activation_function="gelu_new", tie_word_embeddings=True)

_MEASURE = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import psutil, jax
    from pjit_ppo import sharding
    from pjit_ppo.models import load_pretrained, param_shapes, ModelConfig

    def vm(field):  # bytes of a /proc/self/status field
        with open("/proc/self/status") as f:
            line = next(l for l in f if l.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    mesh = sharding.make_mesh(fsdp=8)
    param_shapes(ModelConfig.from_pretrained(sys.argv[1]))   # warm up tracing
    jax.block_until_ready(jax.device_put(1.0))
    try:
        with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM (peak RSS) to now
            f.write("5")
        sampler = None
    except OSError:  # no clear_refs here: sample RSS every millisecond instead
        import threading, time
        samples, done = [], threading.Event()
        def sample():
            while not done.is_set():
                samples.append(vm("VmRSS"))
                time.sleep(0.001)
        sampler = threading.Thread(target=sample)
        sampler.start()
    before = vm("VmRSS")
    config, params = load_pretrained(sys.argv[1], mesh=mesh)
    jax.block_until_ready(params)
    after = vm("VmRSS")
    if sampler is None:
        peak = vm("VmHWM")
    else:
        done.set()
        sampler.join()
        peak = max(samples + [after])
    resident = sum(s.data.nbytes for x in jax.tree_util.tree_leaves(params)
                   for s in x.addressable_shards)
    print(json.dumps(dict(before=before, after=after, peak=peak, resident=resident)))
""")


def _write_big_checkpoint(path):
    """Random fp32 weights in HF GPT-2 layout, written tensor by tensor (no torch)."""
    from pjit_ppo.models import ModelConfig
    from pjit_ppo.models import hf_layout
    config = ModelConfig.from_hf_dict(_BIG)
    maps = hf_layout.tensor_maps(config)
    specs = {}
    for m in maps.values():
        for layer in (range(config.n_layers) if m.layered else [None]):
            specs[m.name(layer)] = m.hf_shape
    rng = np.random.default_rng(0)
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_BIG, f)
    write_safetensors(os.path.join(path, SINGLE_FILE),
                      [(n, s, np.float32) for n, s in sorted(specs.items())],
                      lambda n: rng.standard_normal(specs[n], dtype=np.float32) * 0.02)
    return os.path.getsize(os.path.join(path, SINGLE_FILE))


def test_import_host_memory_stays_bounded(tmp_path):
    """Peak host memory of a sharded import, measured in a fresh subprocess.

    What is measurable: on the CPU backend the 8 fake devices *are* host memory,
    so the imported parameters themselves (`resident`, the bytes of all device
    shards, replicated ones counted per device) must show up in RSS. The claim
    under test is that nothing beyond them is held: no whole-file read, no
    whole-tensor or whole-parameter staging. So we bound

        overhead = peak RSS during the import
                   - RSS before the import - resident parameter bytes

    which counts both transient buffers and anything freed-but-not-returned
    to the OS. RSS includes mapped file pages, so it also checks that the reader
    does not keep the checkpoint file mapped. Transient = peak - RSS after.

    The peak is the kernel's exact high-water mark VmHWM, reset just before the
    import through /proc/self/clear_refs (where that is not writable, RSS
    sampled every millisecond). Not getrusage's ru_maxrss: after fork+exec it
    still carries the forking pytest process's RSS.

    Measured here (328 MB checkpoint, fsdp=8): overhead ~24 MB, transient ~3 MB.
    With jax.make_array_from_callback (all of a parameter's shards staged on the
    host before the transfer) the overhead was ~100 MB, hence
    hf.make_array_shard_by_shard. Runs in ~8 s, so not marked slow.
    """
    ckpt = str(tmp_path / "big")
    size = _write_big_checkpoint(ckpt)
    assert size > 300e6
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _MEASURE, ckpt], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads(result.stdout.strip().splitlines()[-1])
    overhead = m["peak"] - m["before"] - m["resident"]
    transient = m["peak"] - m["after"]
    print(f"checkpoint {size / 1e6:.0f} MB; resident params {m['resident'] / 1e6:.0f} MB; "
          f"RSS before {m['before'] / 1e6:.0f} MB, after {m['after'] / 1e6:.0f} MB, "
          f"peak {m['peak'] / 1e6:.0f} MB; overhead {overhead / 1e6:.0f} MB, "
          f"transient {transient / 1e6:.0f} MB")
    assert m["resident"] >= 0.95 * size  # the params really are in host memory here
    assert overhead < 0.25 * size, m
    assert transient < 0.25 * size, m
