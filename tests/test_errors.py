"""A catalogue of bad launches, each run as a user runs it: `launch/train_ppo.py` in a real
subprocess (8 CPU devices) on a work directory that holds an earlier run.

Every case must end with exit status 2 and exactly one line on stderr (`error: ...`, no
traceback) that names the field and the value and says what to do, before anything is
compiled or loaded; and the earlier run's files (config.json, metrics.jsonl, TensorBoard
events, checkpoints) must be byte-identical afterwards, with nothing added. A launch on
a work directory that did not exist must not create it.

The launches fail within seconds, so the module runs them two at a time up front (one
fixture) and each case then checks its own outcome.
"""
import concurrent.futures
import dataclasses
import json
import os
import shutil
import subprocess
from typing import Dict, Tuple

import pytest

import runs

ROOT_IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad launch: `args` (formatted with the paths of `inputs`), the fragments the
    error line must contain, and whether the work directory is fresh (must stay absent)."""
    id: str
    args: Tuple[str, ...]
    expect: Tuple[str, ...]
    fresh: bool = False
    own_workdir: bool = False   # args give --workdir themselves
    own_config: bool = False    # args give --config themselves


CASES = (
    # Unknown keys and wrong types (config_flags' own errors, as one line).
    Case("unknown_field", ("--config.ppo.lrr=1",),
         ("--config.ppo.lrr=1", "ppo has no field 'lrr'", "did you mean 'lr'")),
    Case("unknown_section", ("--config.optimiser.lr=1",),
         ("--config.optimiser.lr=1", "no field 'optimiser'")),
    Case("unknown_model_key", ("--config.model.random.n_embed=32",),
         ("model.random has no key 'n_embed'", "did you mean 'n_embd'")),
    Case("float_not_a_number", ("--config.ppo.lr=abc",),
         ("--config.ppo.lr=abc", "ppo.lr takes a float")),
    Case("int_given_a_float", ("--config.ppo.batch_size=1.5",),
         ("--config.ppo.batch_size=1.5", "ppo.batch_size takes an int")),
    Case("bool_given_a_word", ("--config.ppo.whiten_rewards=maybe",),
         ("--config.ppo.whiten_rewards=maybe", "takes a bool")),
    Case("unknown_flag", ("--worker=1",), ("unknown flag", "'worker'", "workdir")),
    Case("missing_recipe", ("--config=configs/no_such_recipe.py",),
         ("--config=configs/no_such_recipe.py", "no such recipe file"), own_config=True),
    Case("bad_recipe_variant", ("--config={grpo}:bogus",),
         ("get_config failed", "bogus", "choose one of"), own_config=True),
    Case("stray_argument", ("oops",), ("unexpected arguments: oops",)),
    # Values out of range, NaN anywhere.
    Case("temperature_zero", ("--config.ppo.temperature=0",),
         ("ppo.temperature", "must be > 0", "0.0")),
    Case("top_p_above_one", ("--config.ppo.top_p=1.5",), ("ppo.top_p", "(0, 1]", "1.5")),
    Case("gamma_above_one", ("--config.ppo.gamma=1.5",), ("ppo.gamma=1.5", "[0, 1]")),
    Case("lam_negative", ("--config.ppo.lam=-0.1",), ("ppo.lam=-0.1", "[0, 1]")),
    Case("negative_lr", ("--config.ppo.lr=-0.001",), ("ppo.lr=-0.001", ">= 0")),
    Case("nan_value", ("--config.ppo.vf_coef=nan",), ("ppo.vf_coef=nan", "finite")),
    Case("infinite_value", ("--config.ppo.kl_target=inf",), ("ppo.kl_target=inf", "finite")),
    Case("cliprange_negative", ("--config.ppo.cliprange=-0.2",),
         ("ppo.cliprange=-0.2", "must be > 0", "[1 - cliprange, 1 + cliprange]")),
    Case("cliprange_value_zero", ("--config.ppo.cliprange_value=0",),
         ("ppo.cliprange_value=0", "must be > 0")),
    Case("init_kl_coef_negative", ("--config.ppo.init_kl_coef=-1",),
         ("ppo.init_kl_coef=-1", "must be >= 0")),
    Case("kl_target_zero", ("--config.ppo.kl_target=0",), ("ppo.kl_target=0", "must be > 0")),
    Case("truncate_after_past_response", ("--config.ppo.truncate_token=3",
                                          "--config.ppo.truncate_after=8"),
         ("ppo.truncate_after=8", "ppo.response_length=8", "no response could ever stop")),
    Case("negative_seed", ("--config.ppo.seed=-3",), ("ppo.seed=-3", "integer >= 0")),
    Case("negative_head_seed", ("--config.reward.head_seed=-1",),
         ("reward.head_seed=-1", "integer >= 0")),
    # Batch arithmetic and the mesh.
    Case("batch_vs_accumulation", ("--config.ppo.gradient_accumulation_steps=3",),
         ("ppo.gradient_accumulation_steps=3", "not divisible")),
    Case("batch_vs_devices", ("--config.ppo.batch_size=40", "--config.ppo.total_episodes=400"),
         ("ppo.batch_size=40", "ppo.nminibatches=2", "8 batch devices", "= 16")),
    Case("mesh_vs_device_count", ("--config.mesh.fsdp=3",),
         ("mesh.fsdp=3", "multiply to 3", "8 are available", "-1")),
    Case("mesh_fixed_axes_do_not_divide", ("--config.mesh.tensor=3",),
         ("mesh.tensor=3", "not divisible by the fixed axes")),
    Case("mesh_vs_heads", ("--config.mesh.fsdp=1", "--config.mesh.tensor=8"),
         ("does not fit the policy", "heads', size 4", "tensor=8")),
    Case("mesh_vs_d_model", ("--config.model.random.n_embd=60", "--config.model.random.n_head=4",
                             "--config.mesh.fsdp=8"),
         ("does not fit the policy", "'embed', size 60", "fsdp=8")),
    # The model against the config.
    Case("context_too_long", ("--config.ppo.query_length=60",),
         ("ppo.query_length=60", "ppo.response_length=8", "context of 64")),
    Case("stop_token_outside_vocab", ("--config.ppo.truncate_token=64",),
         ("ppo.truncate_token=64", "vocabulary of 64")),
    Case("unknown_remat_policy", ("--config.model.remat_policy=sometimes",),
         ("model.remat_policy='sometimes'", "jax.checkpoint_policies")),
    # Paths.
    Case("missing_model_dir", ("--config.model.policy_path={missing}",),
         ("model.policy_path=", "no_such_dir", "no such file or directory", "HF model")),
    Case("model_dir_without_weights", ("--config.model.policy_path={no_weights}",),
         ("model.policy_path=", "no weights", "model.safetensors")),
    Case("weights_do_not_match_config", ("--config.model.policy_path={wrong_weights}",),
         ("model.policy_path=", "wrong_weights", "tensor", "match")),
    Case("model_config_not_json", ("--config.model.policy_path={bad_json}",),
         ("model.policy_path=", "config.json cannot be read as JSON")),
    Case("missing_reward_dir", ("--config.reward.kind=model", "--config.reward.path={missing}"),
         ("reward.path=", "no_such_dir", "no such file or directory")),
    Case("missing_prompts", ("--config.data.prompts_path={missing}.jsonl",
                             "--config.data.tokenizer_path={inputs}"),
         ("data.prompts_path=", "no_such_dir.jsonl", "no such file or directory")),
    Case("missing_tokenizer", ("--config.data.prompts_path={prompts}",
                               "--config.data.tokenizer_path={missing}"),
         ("data.tokenizer_path=", "no such file or directory", "tokenizer")),
    Case("prompts_without_tokenizer", ("--config.data.prompts_path={prompts}",),
         ("data.prompts_path=", "needs a tokenizer", "data.tokenizer_path")),
    Case("recipe_without_downloads", ("--config={sentiment}",),
         ("data.prompts_path='data/books_prompts.jsonl'", "no such file or directory"),
         own_config=True),
    # The work directory.
    Case("workdir_under_a_file", ("--workdir={plain_file}/run",),
         ("--workdir=", "is a file", "choose another directory"), own_workdir=True),
    Case("workdir_is_a_file", ("--workdir={plain_file}",), ("--workdir=", "is a file"),
         own_workdir=True),
    Case("workdir_missing", ("--config.num_iterations=1",),
         ("workdir", "must have a value"), own_workdir=True),
    # A fresh work directory is not created by a failed launch.
    Case("fresh_workdir_not_created", ("--config.ppo.lr=nan",), ("ppo.lr=nan", "finite"),
         fresh=True),
)
if not ROOT_IS_ROOT:  # root writes through permission bits
    CASES += (Case("workdir_not_writable", ("--workdir={read_only}/run",),
                   ("--workdir=", "cannot be written"), own_workdir=True),)


def _previous_run(path) -> None:
    """A work directory as an earlier run leaves it (contents are opaque bytes here)."""
    (path / "tensorboard").mkdir(parents=True)
    (path / "checkpoints" / "3" / "policy").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"previous": "run"}))
    (path / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2}\n{"iteration": 3}\n')
    (path / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"\x00\x01events")
    (path / "checkpoints" / "3" / "policy" / "data").write_bytes(b"\x07" * 64)


def _snapshot(path) -> Dict[str, bytes]:
    """Every file under `path` with its bytes, and every directory (value None)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        rel = os.path.relpath(dirpath, path)
        out[rel] = None
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.normpath(os.path.join(rel, name))] = f.read()
    return out


def _inputs(root) -> Dict[str, str]:
    """Files the cases point at: a model directory without weights, one whose config.json
    is not JSON, a prompts file, a plain file, a read-only directory."""
    inputs = root / "inputs"
    (inputs / "no_weights").mkdir(parents=True)
    (inputs / "no_weights" / "config.json").write_text(json.dumps(dict(
        model_type="gpt2", vocab_size=64, n_embd=64, n_layer=2, n_head=4, n_positions=64)))
    (inputs / "bad_json").mkdir()
    (inputs / "bad_json" / "config.json").write_text("{not json")
    (inputs / "bad_json" / "model.safetensors").write_bytes(b"")
    (inputs / "wrong_weights").mkdir()
    shutil.copy(inputs / "no_weights" / "config.json", inputs / "wrong_weights")
    header = json.dumps({"transformer.wte.weight": {"dtype": "F32", "shape": [2, 2],
                                                    "data_offsets": [0, 16]}}).encode()
    (inputs / "wrong_weights" / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + bytes(16))
    (inputs / "prompts.jsonl").write_text('{"prompt": "Hello there."}\n')
    (inputs / "plain_file").write_text("not a directory")
    (inputs / "read_only").mkdir()
    os.chmod(inputs / "read_only", 0o500)
    return dict(inputs=str(inputs), missing=str(inputs / "no_such_dir"),
                no_weights=str(inputs / "no_weights"), wrong_weights=str(inputs / "wrong_weights"),
                bad_json=str(inputs / "bad_json"),
                prompts=str(inputs / "prompts.jsonl"), plain_file=str(inputs / "plain_file"),
                read_only=str(inputs / "read_only"), grpo=os.path.join(runs.ROOT, "configs",
                                                                       "grpo_demo.py"),
                sentiment=os.path.join(runs.ROOT, "configs", "gpt2_sentiment.py"))


def _launch(case: Case, root, inputs):
    workdir = root / case.id / "run"
    if not case.fresh:
        _previous_run(workdir)
    before = _snapshot(workdir) if workdir.exists() else None
    args = [a.format(**inputs) for a in case.args]
    if not case.own_config:
        args.insert(0, f"--config={runs.TINY}")
    if not case.own_workdir:
        args.insert(1, f"--workdir={workdir}")
    # No malloc re-exec: these launches never compute (and start twice as fast).
    proc = subprocess.run(runs.command("train_ppo.py", *args), cwd=root / case.id,
                          env=runs.env(devices=8, PJIT_PPO_MALLOC_TUNING="0"),
                          capture_output=True, text=True, timeout=300)
    after = _snapshot(workdir) if workdir.exists() else None
    return proc, before, after


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_launches")
    inputs = _inputs(root)
    for case in CASES:
        (root / case.id).mkdir()
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {case.id: pool.submit(_launch, case, root, inputs) for case in CASES}
        results = {name: future.result() for name, future in futures.items()}
    os.chmod(inputs["read_only"], 0o700)
    return results


def test_catalogue_is_large_enough():
    assert len(CASES) >= 20 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_launch(case, outcomes):
    proc, before, after = outcomes[case.id]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: "), lines[0]
    for fragment in case.expect:
        assert fragment in lines[0], (fragment, lines[0])
    if case.fresh:
        assert before is None and after is None, "a failed launch created the work directory"
    elif not case.own_workdir:
        assert after == before, "a failed launch changed the earlier run's files"


def test_config_json_is_written_only_after_build(tmp_path):
    """run.train refuses a config the checks let through only when it builds (here: a
    prompts file that is empty) and leaves the earlier config.json as it was."""
    workdir = tmp_path / "run"
    _previous_run(workdir)
    before = _snapshot(workdir)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    proc = runs.run("train_ppo.py", f"--config={runs.TINY}", f"--workdir={workdir}",
                    f"--config.data.prompts_path={empty}", f"--config.data.tokenizer_path="
                    f"{tokenizer}", "--config.measure_peak=false", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, proc.stderr[-3000:]
    after = _snapshot(workdir)
    for name in ("config.json", "metrics.jsonl", os.path.join("tensorboard",
                                                              "events.out.tfevents.1.host")):
        assert after[name] == before[name], name
    shutil.rmtree(workdir)


@pytest.mark.parametrize("script,args,expect", [
    ("evaluate.py", ("--config={tiny}", "--workdir={missing}"),
     ("--workdir=", "no such directory", "the --workdir it was trained with")),
    ("evaluate.py", ("--config={tiny}", "--workdir={inputs}",
                     "--config.evaluation.num_prompts=-1"),
     ("evaluation.num_prompts=-1", ">= 0")),
    ("export_hf.py", ("--workdir={missing}", "--output={inputs}/out"),
     ("--workdir=", "no such directory")),
    ("export_hf.py", ("--workdir={inputs}", "--output={plain_file}"),
     ("--output=", "is a file")),
], ids=["evaluate_missing_workdir", "evaluate_bad_value", "export_missing_workdir",
        "export_output_is_a_file"])
def test_other_entry_points_check_before_starting(script, args, expect, tmp_path):
    inputs = _inputs(tmp_path)
    inputs["tiny"] = runs.TINY
    before = _snapshot(tmp_path)
    proc = subprocess.run(runs.command(script, *(a.format(**inputs) for a in args)),
                          cwd=tmp_path, env=runs.env(PJIT_PPO_MALLOC_TUNING="0"),
                          capture_output=True, text=True, timeout=300)
    os.chmod(inputs["read_only"], 0o700)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for fragment in expect:
        assert fragment in lines[0], (fragment, lines[0])
    assert _snapshot(tmp_path) == before


def test_reward_directory_without_a_head_is_refused_unless_asked(tmp_path):
    """A plain language model given as reward.path would score with a random head: refused
    with the file it lacks and how to make one; reward.allow_random_head=True runs it, with
    a warning in the log."""
    import tiny_hf
    plain = tmp_path / "plain_lm"
    tiny_hf.save_model("gpt2", str(plain), n_embd=64, vocab_size=64, pad_token_id=63)
    workdir = tmp_path / "run"
    _previous_run(workdir)
    before = _snapshot(workdir)
    args = (f"--config={runs.TINY}", f"--workdir={workdir}", "--config.reward.kind=model",
            f"--config.reward.path={plain}", "--config.measure_peak=false")
    proc = runs.run("train_ppo.py", *args, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for fragment in (f"reward.path='{plain}'", "no reward_head.safetensors", "pjit-ppo-reward",
                     "reward.allow_random_head=True"):
        assert fragment in lines[0], (fragment, lines[0])
    assert _snapshot(workdir) == before
    fresh = tmp_path / "smoke"
    proc = runs.run("train_ppo.py", *args[:1], f"--workdir={fresh}", *args[2:],
                    "--config.reward.allow_random_head=true", "--config.num_iterations=1",
                    timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "random reward head" in proc.stderr and "smoke test" in proc.stderr


@pytest.mark.parametrize("lines,expect", [
    ('{"prompt": "the cat sees"}\nnot json\n', "prompts.jsonl:2: not valid JSON"),
    ('{"prompt": "the cat sees"}\n{"text": "a dog"}\n', "prompts.jsonl:2"),
], ids=["bad_jsonl_line", "missing_prompt_field"])
def test_refused_data_leaves_a_fresh_workdir_absent(tmp_path, lines, expect):
    """A data error found while the run is built (after the launch checks passed) ends
    with one line and exit 2, and a work directory that did not exist is not left behind
    (no logs/, no checkpoints/)."""
    import tiny_text
    tiny_text.save_tokenizer(str(tmp_path / "tok"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(lines)
    workdir = tmp_path / "fresh" / "run"
    proc = runs.run("train_ppo.py", f"--config={runs.TINY}", f"--workdir={workdir}",
                    f"--config.data.prompts_path={prompts}",
                    f"--config.data.tokenizer_path={tmp_path / 'tok'}",
                    "--config.measure_peak=false", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and expect in error[0], proc.stderr[-3000:]
    assert not (tmp_path / "fresh").exists()  # nor the parent the launch would have made
