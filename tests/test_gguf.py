"""GGUF import (pjit_ppo.models.gguf) on tiny Llama GGUF files written here with gguf.GGUFWriter.

Each tested tensor type (F32, F16, BF16, Q8_0, Q4_0, Q4_1: quantized with gguf.quants;
Q4_K, Q6_K: random valid blocks, since the gguf package cannot quantize K-quants) with
tied and untied embeddings, grouped-query attention, Q / K rows permuted as llama.cpp's
converter does. Checked: our parameters equal the gguf package's dequantization (Q / K
permutation undone), our logits equal transformers' on those weights, sharded import,
export to an HF directory, the tokenizer, and that the library path never imports torch.
"""
import functools
import os
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pjit_ppo import sharding
from pjit_ppo.data import prompts
from pjit_ppo.errors import CheckpointError
from pjit_ppo.models import ModelConfig, ModelConfigError, lm_logits, load_pretrained, save_pretrained
from pjit_ppo.models import gguf as gguf_import
from pjit_ppo.models import gguf_file

# Rows of quantized tensors must be whole blocks: 32 values, 256 for K-quants.
D, FF, HEADS, KV, LAYERS, VOCAB, CONTEXT = 256, 256, 4, 2, 2, 96, 64
HEAD_DIM = D // HEADS
BOS = EOS = VOCAB - 2  # "<|endoftext|>" of the placeholder vocabulary
PAD = VOCAB - 1  # "<pad>"
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
ATOL = 1e-4
# HF Llama names -> llama.cpp's (written out here, independently of the library's table).
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# f16 scale fields of K-quant blocks: (byte offset, low, high); other bytes are random.
K_SCALES = {"Q4_K": [(0, 1e-4, 3e-4), (2, 1e-3, 2e-3)], "Q6_K": [(208, 2e-5, 4e-5)]}


# ------------------------------------------------------------------ fixtures
def hf_model(tied: bool, seed: int = 0) -> transformers.LlamaForCausalLM:
    """A random float32 transformers Llama of the test's sizes; weights ~ 1/sqrt(fan_in)."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=tied, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3 if "embed" in name else p.shape[1] ** -0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model


def gguf_name(hf: str) -> str:
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q / K rows (HF -> GGUF)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def encode(x: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """x [rows, cols] float32 as GGUF data of type `kind` (uint8 blocks, or float arrays)."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind not in K_SCALES:
        return gguf.quants.quantize(x, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks = x.shape[0], x.shape[1] // block
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for offset, low, high in K_SCALES[kind]:
        scale = rng.uniform(low, high, (rows, blocks)).astype(np.float16)
        raw[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * size)


def write_gguf(path, tensors, *, arch="llama", tokenizer=None, **metadata):
    """A GGUF file: Llama metadata of the test's sizes (or `metadata`), `tensors` {name: (data,
    type name)}, and `tokenizer` {tokens, types, merges, bos, eos, pad} (default: a
    placeholder vocabulary of VOCAB tokens)."""
    w = gguf.GGUFWriter(str(path), arch)
    meta = dict(context_length=CONTEXT, embedding_length=D, block_count=LAYERS,
                feed_forward_length=FF, head_count=HEADS, head_count_kv=KV,
                layer_norm_rms_eps=1e-5, rope_freq_base=10000.0, rope_dimension_count=HEAD_DIM)
    meta.update(metadata)
    for key, value in meta.items():
        getattr(w, f"add_{key}")(value)
    chars = [chr(c) for c in range(33, 33 + VOCAB - 3)]  # single characters, "ab", specials
    tok = tokenizer or dict(tokens=chars + ["ab", "<|endoftext|>", "<pad>"],
                            types=[1] * (VOCAB - 2) + [3, 3], merges=["a b"], bos=BOS, eos=EOS,
                            pad=PAD)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    w.add_pad_token_id(tok["pad"])
    for name, (data, kind) in tensors.items():
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_of(model, kind: str, seed: int = 0):
    """({GGUF name: (data, type)}, {HF name: float32 weights as the file holds them}).

    2-D weights in `kind`, norms in F32 (as llama.cpp writes them); the second dict is
    the gguf package's dequantization with the Q / K permutation undone.
    """
    rng = np.random.default_rng(seed)
    tied = model.config.tie_word_embeddings
    tensors, weights = {}, {}
    for hf, p in model.state_dict().items():
        if tied and hf == "lm_head.weight":
            continue
        x = p.numpy().astype(np.float32)
        heads = HEADS if "q_proj" in hf else KV if "k_proj" in hf else None
        if heads:
            x = permute(x, heads)
        t = kind if x.ndim == 2 else "F32"
        data = encode(x, t, rng)
        tensors[gguf_name(hf)] = (data, t)
        x = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[t]).reshape(x.shape)
        weights[hf] = unpermute(x, heads) if heads else x
    return tensors, weights


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(kind, tied) -> (GGUF path, HF dir with the dequantized weights, transformers model on
    them), made once per module."""
    cache = {}

    def get(kind, tied):
        if (kind, tied) not in cache:
            model = hf_model(tied)
            tensors, weights = gguf_of(model, kind)
            base = tmp_path_factory.mktemp(f"{kind}_{'tied' if tied else 'untied'}")
            path = str(base / "model.gguf")
            write_gguf(path, tensors)
            with torch.no_grad():
                for name, p in model.state_dict().items():
                    if name in weights:
                        p.copy_(torch.from_numpy(weights[name]))
            model.save_pretrained(str(base / "hf"))
            cache[(kind, tied)] = (path, str(base / "hf"), model)
        return cache[(kind, tied)]

    return get


def batch(seed=0, rows=3, length=12):
    """ids int32 [B, T], mask bool [B, T] (row 1 left-padded by 4)."""
    ids = np.random.RandomState(seed).randint(2, PAD, (rows, length)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    mask[1, :4] = False
    ids[~mask] = PAD
    return ids, mask


def hf_logits(model, ids, mask):
    m = torch.tensor(mask.astype(np.int64))
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids.astype(np.int64)), attention_mask=m,
                    position_ids=(m.cumsum(-1) - 1).clamp(min=0))
    return out.logits.float().numpy()


def assert_same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_config_from_metadata(files, tied):
    path, hf_dir, _ = files("F32", tied)
    config = ModelConfig.from_pretrained(path, compute_dtype="bfloat16")
    want = ModelConfig.from_pretrained(hf_dir, compute_dtype="bfloat16")
    assert config == want  # the same architecture as transformers' config.json of the model
    assert (config.architecture, config.vocab_size, config.d_model, config.n_layers,
            config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff,
            config.max_positions) == ("llama", VOCAB, D, LAYERS, HEADS, KV, HEAD_DIM, FF, CONTEXT)
    assert config.tie_word_embeddings is tied
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (BOS, EOS, PAD)
    assert config.norm_eps == pytest.approx(1e-5) and config.rope_theta == 10000.0
    assert config.compute_dtype == "bfloat16"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", TYPES)
def test_params_and_logits(files, kind, tied):
    """Our import == the gguf package's dequantization (HF layout); logits == transformers'."""
    path, hf_dir, model = files(kind, tied)
    config, params = load_pretrained(path)
    _, want = load_pretrained(hf_dir)
    assert ("lm_head" in params) is not tied
    assert_same_params(params, want)
    # The Q / K permutation, spelled out on the file's own bytes: layer 1's K projection.
    t = gguf_file.open_file(path).tensors["blk.1.attn_k.weight"]
    raw = np.fromfile(path, np.uint8, t.row_bytes * t.shape[0], offset=t.offset)
    k = gguf.quants.dequantize(raw.reshape(t.shape[0], t.row_bytes),
                               gguf.GGMLQuantizationType[t.ggml_type])
    k = k.reshape(KV, HEAD_DIM // 2, 2, D).transpose(0, 2, 1, 3)  # [kv, half, j, d]
    np.testing.assert_array_equal(np.asarray(params["transformer/layers/attn/k"]["w"][1]),
                                  k.reshape(KV, HEAD_DIM, D).transpose(2, 0, 1))
    ids, mask = batch()
    ours = np.asarray(jax.jit(functools.partial(lm_logits, config))(params, ids, mask))
    err = np.abs(ours - hf_logits(model, ids, mask))[mask].max()
    assert err <= ATOL, f"{kind} tied={tied}: max abs logit diff {err}"


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0"])
def test_sharded_import_and_bfloat16(files, kind, monkeypatch):
    """On a 4x2 mesh (heads split, d_model split), in small read windows: the same values."""
    path, _, _ = files(kind, False)
    _, single = load_pretrained(path)
    monkeypatch.setattr(gguf_file, "READ_WINDOW_BYTES", 4 * D * 3)  # 3 rows per window
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    _, sharded = load_pretrained(path, mesh=mesh)
    q = sharded["transformer/layers/attn/q"]["w"]
    assert len({str(s.index) for s in q.addressable_shards}) == 8  # really split 8 ways
    assert_same_params(sharded, single)
    _, half = load_pretrained(path, mesh=mesh, dtype="bfloat16")
    assert_same_params(half, jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), single))


def test_reader_slices(files):
    """GGUFCheckpoint.read of row ranges cutting through heads and of column ranges."""
    path, hf_dir, model = files("Q4_0", False)
    reader = gguf_import.GGUFCheckpoint(path)
    q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert reader.shape(name) == (D, D) and reader.tensors[name].ggml_type == "Q4_0"
    for rows, cols in [(slice(3, 70), slice(None)), (slice(100, 101), slice(64, 128)),
                       (slice(0, D), slice(200, 256))]:
        np.testing.assert_array_equal(reader.read(name, [rows, cols]), q[rows, cols])
    assert "lm_head.weight" in reader and "model.layers.2.mlp.up_proj.weight" not in reader


def test_export_writes_hf_directory(files, tmp_path):
    """A model imported from GGUF, saved with save_pretrained: transformers loads it and its
    logits are ours."""
    path, _, model = files("Q6_K", True)
    config, params = load_pretrained(path, mesh=sharding.make_mesh(fsdp=8))
    save_pretrained(str(tmp_path), config, params)
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    assert exported.config.tie_word_embeddings and exported.config.num_key_value_heads == KV
    ids, mask = batch(seed=1)
    ours = np.asarray(jax.jit(functools.partial(lm_logits, config))(params, ids, mask))
    np.testing.assert_allclose(hf_logits(exported, ids, mask)[mask], ours[mask], atol=ATOL)
    assert ModelConfig.from_pretrained(str(tmp_path)) == config


def train_bpe():
    """A byte-level BPE tokenizer (`tokenizers`), like GPT-2's, with two special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = [f"the {a} {b} sees {n} {c}s, doesn't it?" for a in ("quick", "lazy", "happy")
             for b in ("cat", "dog", "bird") for c in ("fish", "tree") for n in (3, 14, 159)]
    tok.train_from_iterator(lines * 3, trainer=trainer)
    return tok


def test_tokenizer(tmp_path):
    """The HF tokenizer rebuilt from GGUF metadata (as llama.cpp writes a gpt2-type vocabulary)
    encodes and decodes like the source tokenizer."""
    import json
    src = train_bpe()
    model = json.loads(src.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    special = {"<|endoftext|>": 0, "<pad>": 1}
    path = str(tmp_path / "tok.gguf")
    write_gguf(path, {}, tokenizer=dict(
        tokens=tokens, types=[3 if t in special else 1 for t in tokens], merges=merges,
        bos=special["<|endoftext|>"], eos=special["<|endoftext|>"], pad=special["<pad>"]))
    out = str(tmp_path / "tokenizer")
    written = gguf_import.save_tokenizer(path, out)
    assert "tokenizer.json" in written
    texts = ["the quick cat sees 14 fishs, doesn't it?", "  Hello,\tworld!\n\nNew line 2024.",
             "Ünïcödé — 🙂 日本語", "<|endoftext|>the dog<|endoftext|>"]
    for tok in (transformers.AutoTokenizer.from_pretrained(out), prompts.load_tokenizer(path)):
        assert len(tok) == src.get_vocab_size()
        assert (tok.eos_token, tok.bos_token, tok.pad_token) == ("<|endoftext|>",) * 2 + ("<pad>",)
        assert tok.pad_token_id == 1 and tok.eos_token_id == 0
        for text in texts:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert ids == src.encode(text).ids, text
            assert tok.decode(ids) == text


def test_errors(files, tmp_path):
    path, _, _ = files("F32", True)
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        load_pretrained(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        ModelConfig.from_pretrained(str(bad))
    other = str(tmp_path / "qwen.gguf")
    write_gguf(other, {}, arch="qwen2")
    with pytest.raises(ModelConfigError, match="'qwen2' is not supported; supported: llama"):
        ModelConfig.from_pretrained(other)
    scaled = str(tmp_path / "scaled.gguf")
    write_gguf(scaled, {"token_embd.weight": (np.zeros((VOCAB, D), np.float32), "F32")},
               rope_scaling_type=gguf.RopeScalingType.LINEAR)
    with pytest.raises(ModelConfigError, match="scaled rotary"):
        ModelConfig.from_pretrained(scaled)
    # A tensor missing from the file: hf.load_pretrained's message, with the file named.
    tensors, _ = gguf_of(hf_model(True), "F32")
    del tensors["blk.1.ffn_up.weight"]
    holed = str(tmp_path / "holed.gguf")
    write_gguf(holed, tensors)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*holed"):
        load_pretrained(holed)


def test_library_path_imports_no_torch(files):
    """Config, weights and tokenizer from a GGUF file with torch made unimportable."""
    path, _, _ = files("Q4_1", False)
    code = ("import sys; sys.modules['torch'] = None\n"
            "from pjit_ppo.models import ModelConfig, gguf, load_pretrained\n"
            f"config, params = load_pretrained({path!r})\n"
            f"tok = gguf.load_tokenizer({path!r})\n"
            "print(config.n_layers, len(tok))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(LAYERS), str(VOCAB)]
