"""A PPO run with LoRA adapters as users meet its checkpoints, through the entry points:
kill -9 and the same command again ends as the uninterrupted run; a resume on other base
weights is refused in one line; pjit-ppo-evaluate reads the checkpoint; pjit-ppo-export
writes the merged model (transformers' logits = ours) and, with --adapters_only, a PEFT
adapter directory (peft's logits = ours)."""
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import runs
import tiny_hf
from pjit_ppo import checkpoint, lora_checkpoints, sharding
from pjit_ppo.config import RunConfig
from pjit_ppo.loading import load_lm
from pjit_ppo.models import forward, lora

pytestmark = pytest.mark.slow

RECIPE = """
import sys
sys.path.insert(0, {configs!r})
import tiny_demo


def get_config(arg=""):
    config = tiny_demo.get_config()
    config.model.policy_path, config.model.random = {base!r}, {{}}
    config.model.lora.rank, config.model.lora.alpha, config.model.lora.dropout = 4, 8.0, 0.05
    config.ppo.pad_token_id, config.ppo.batch_size, config.ppo.noptepochs = 95, 32, 1
    return config
"""
ITERATIONS = 6


def _recipe(path, base):
    path.write_text(RECIPE.format(configs=os.path.join(runs.ROOT, "configs"), base=str(base)))
    return str(path)


def _args(recipe, workdir, iterations=ITERATIONS, *extra):
    return (f"--config={recipe}", f"--workdir={workdir}",
            f"--config.num_iterations={iterations}", "--config.checkpoint.every=2",
            "--config.measure_peak=false", *extra)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(recipe, base model directory, the workdir of one uninterrupted run)."""
    d = tmp_path_factory.mktemp("lora_run")
    tiny_hf.save_model("llama", str(d / "base"))
    recipe = _recipe(d / "recipe.py", d / "base")
    workdir = d / "uninterrupted"
    proc = runs.run("train_ppo.py", *_args(recipe, workdir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return recipe, d / "base", workdir


def _arrays(workdir, step):
    out = {}
    with ocp.StandardCheckpointer() as ckptr:
        for item in ("policy", "rest", "opt_state", "train"):
            tree = ckptr.restore(os.path.join(workdir, "checkpoints", str(step), item))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
                out[item + jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


def test_checkpoint_holds_adapters_and_the_base_fingerprint(setup):
    _, _, workdir = setup
    arrays = _arrays(workdir, ITERATIONS)
    policy = [k for k in arrays if k.startswith("policy")]
    assert policy and all(re.search(r"'lora_[ab]'\]$", k) for k in policy), policy
    critic = [k for k in arrays if k.startswith("rest")]
    assert all(re.search(r"'(lora_[ab]|w|b)'\]$", k) for k in critic)
    assert any("value_head" in k for k in critic)
    _, info = checkpoint.RunCheckpointer(str(workdir), read_only=True).resolve(None)
    assert set(info["lora_base"]) == {"policy", "critic"}
    assert "base of the LoRA adapters" in info["frozen"]["reference"]


def test_kill_9_then_the_same_command_ends_as_the_uninterrupted_run(setup, tmp_path):
    recipe, _, reference = setup
    workdir = tmp_path / "run"
    args = _args(recipe, workdir)
    proc = runs.start("train_ppo.py", *args, log_path=tmp_path / "1.log")
    runs.wait_for(lambda: runs.metric_lines(workdir) >= 3, proc=proc)
    runs.kill(proc)
    proc = runs.run("train_ppo.py", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"resuming from checkpoint [24] ", proc.stderr), proc.stderr[-3000:]
    runs.assert_same_metrics(reference / "metrics.jsonl", workdir / "metrics.jsonl")
    a, b = _arrays(reference, ITERATIONS), _arrays(workdir, ITERATIONS)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_resume_on_other_base_weights_is_refused_in_one_line(setup, tmp_path):
    """A run's base model replaced by other weights at the same path: the same command
    (a longer run) is refused in one line naming the fingerprint, and nothing in the
    work directory changes. The run is a copy of the uninterrupted one; the module's base
    directory gets other weights for the one refused launch and its own back after."""
    recipe, base, reference = setup
    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    shutil.copytree(base, tmp_path / "base_backup")
    before = {p: open(p, "rb").read() for p in map(str, workdir.rglob("*")) if os.path.isfile(p)}
    try:
        shutil.rmtree(base)
        tiny_hf.save_model("llama", str(base), seed=1)  # same path, other weights
        proc = runs.run("train_ppo.py", *_args(recipe, workdir, ITERATIONS + 2))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.copytree(tmp_path / "base_backup", base)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"cannot resume from checkpoint {ITERATIONS}" in errors[0] \
        and "fingerprint" in errors[0]
    after = {p: open(p, "rb").read() for p in map(str, workdir.rglob("*")) if os.path.isfile(p)
             and not p.startswith(str(workdir / "logs"))}
    assert {p: v for p, v in before.items() if not p.startswith(str(workdir / "logs"))} == after


def test_evaluate_reads_the_lora_checkpoint(setup):
    recipe, _, workdir = setup
    proc = runs.run("evaluate.py", f"--config={recipe}", f"--workdir={workdir}",
                    "--config.evaluation.num_prompts=64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((workdir / "eval" / str(ITERATIONS) / "eval.json").read_text())
    assert report["checkpoint_step"] == ITERATIONS and report["num_prompts"] == 64
    assert np.isfinite(report["reward_mean"]) and report["kl_mean"] > 0


@pytest.fixture(scope="module")
def ours(setup):
    """(ids, logits of the checkpoint's adapted policy, logits of its base) for both export
    tests: one load and one forward each (after the refused resume put the base back)."""
    ids = np.random.default_rng(0).integers(0, tiny_hf.VOCAB, (3, 10))
    return (ids, *_ours(setup[2], ids))


def _ours(workdir, ids):
    """Logits of the checkpoint's adapted policy (the unmerged forward on the fp32 base)."""
    ckpt = checkpoint.RunCheckpointer(str(workdir), read_only=True)
    step, info = ckpt.resolve(None)
    config = RunConfig.from_dict(info["config"])
    mesh = sharding.make_mesh(fsdp=-1)
    base_cfg, base = load_lm(config.model, config.model.policy_path, mesh, config.ppo.seed)
    adapted = lora_checkpoints.adapted_config(config.model, base_cfg)
    _, adapters = lora_checkpoints.restore_adapters(ckpt, step, adapted, mesh)
    assert float(jnp.abs(adapters["transformer/layers/attn/q"]["lora_b"]).max()) > 0
    mask = np.ones_like(ids, bool)
    return (np.asarray(forward(adapted, lora.attach(base, adapters), ids, mask)[1]),
            np.asarray(forward(base_cfg, base, ids, mask)[1]))


def test_export_merges_the_adapters_into_an_hf_directory(setup, ours, tmp_path):
    import torch
    import transformers
    _, _, workdir = setup
    out = tmp_path / "hf"
    proc = runs.run("export_hf.py", f"--workdir={workdir}", f"--output={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids, ours, base = ours
    model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)
    assert np.abs(ours - base).max() > 1e-3  # the adapters are in it


def test_export_adapters_only_is_a_peft_directory(setup, ours, tmp_path):
    peft = pytest.importorskip("peft")
    import torch
    import transformers
    _, base_dir, workdir = setup
    out = tmp_path / "adapters"
    proc = runs.run("export_hf.py", f"--workdir={workdir}", f"--output={out}",
                    "--adapters_only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == str(base_dir)
    ids, ours, _ = ours
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir).float().eval()
    model = peft.PeftModel.from_pretrained(model, str(out)).eval()
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)
