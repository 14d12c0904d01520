"""Rewards written in Python (reward.kind="function", reward.terms), as users meet them:
`launch/train_ppo.py` in real subprocesses (8 CPU devices) on text prompts with metadata.

- the scores a function returns are exactly what training uses (a function logs its
  outputs; the test recomputes objective/scores and the sample table from the log);
  the responses it sees are cut at the stop token; each row gets its own prompt record;
- every way a user's function can fail ends the launch with exit status 2 and one
  `error:` line before anything is compiled (a dry call at launch), and a failure in the
  middle of training leaves the latest checkpoint and every earlier file intact;
- once the function works again, kill -9 mid-run and the same command again: the same
  metrics and sample tables as an uninterrupted run;
- the split rollout (sampling, host, scoring) computes what the single program does;
- pjit-ppo-evaluate scores held-out samples with the function (and reports each term);
- the planner plans a run with function terms;
- GRPO with the built-in exact-match and format-check functions (pjit_ppo.rewards.
  functions) as weighted terms learns on text prompts with an `answer` field.
"""
import concurrent.futures
import dataclasses
import json
import os
import re
import subprocess

import jax
import numpy as np
import pytest

import runs
import tiny_text

GRPO = os.path.join(runs.ROOT, "configs", "grpo_demo.py")
#: The runs through train_ppo.py (`_args`) train one PPO epoch per iteration
#: (runs.ONE_EPOCH): they check how scores reach training, not learning.
ITERATIONS = 6
#: With 8 devices, 64 episodes (16 prompts x 4 samples) and rollout micro-batches of 32,
#: each device holds 8 rows and each micro-batch 4 of them: the rows of micro-batch c.
DEVICES, BATCH, MICRO, G = 8, 64, 32, 4
CALL_ROWS = [[d * 8 + c * 4 + k for d in range(DEVICES) for k in range(4)] for c in range(2)]

REWARDS_PY = '''
"""Reward functions of the tests: each logs its calls to $REWARD_LOG."""
import json
import math
import os
import time

CALLS = [0]


def _log(prompts, responses, metadata, scores):
    path = os.environ.get("REWARD_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"prompts": prompts, "responses": responses,
                                "metadata": metadata, "scores": scores}) + "\\n")


def words(prompts, responses, **metadata):
    """(number of words mod 4) / 4: multiples of 1/4, so every mean is exact in float32.
    FAIL_AT_CALL=k: from the k-th call of the process on, FAIL_MODE "raise" raises for
    every response of two words or more, "inf" scores the first row inf.
    SLOW_FROM_CALL=k: from the k-th call on, each call takes a second longer (the scores
    are the same), so that a kill after an iteration lands before the run ends."""
    CALLS[0] += 1
    if CALLS[0] >= int(os.environ.get("SLOW_FROM_CALL") or 10**9):
        time.sleep(1.0)
    scores = [len(r.split()) % 4 / 4 for r in responses]
    _log(prompts, responses, metadata, scores)
    if CALLS[0] >= int(os.environ.get("FAIL_AT_CALL") or 10**9):
        if os.environ.get("FAIL_MODE") == "inf":
            scores[0] = math.inf
        elif any(len(r.split()) >= 2 for r in responses):
            raise RuntimeError("the scoring service is unavailable\\nretry in 5 minutes")
    return scores


def one_arg(responses):
    return [0.0] * len(responses)


def raises_on_difficulty(prompts, responses, difficulty, **metadata):
    out = []
    for d in difficulty:
        if d == 2:
            raise KeyError(f"no rubric for difficulty {d}")
        out.append(1.0)
    return out


def one_short(prompts, responses, **metadata):
    return [1.0] * (len(responses) - 1)


def words_not_numbers(prompts, responses, **metadata):
    return ["high"] * len(responses)


def not_finite(prompts, responses, **metadata):
    return [0.0, math.nan] + [0.0] * (len(responses) - 2)


def nothing(prompts, responses, **metadata):
    return None


NOT_CALLABLE = 3
'''


def _prompt_records():
    out = []
    for i, (s, v, o) in enumerate((s, v, o) for s in tiny_text.SUBJECTS for v in tiny_text.VERBS
                                  for o in tiny_text.OBJECTS):
        if i % 3 == 0:  # 22 distinct prompts, each with its own answer
            out.append({"prompt": f"{s} {v} {o}", "answer": str(i % 10), "difficulty": i % 4})
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("function_reward")
    tiny_text.save_tokenizer(str(root / "tok"))
    records = _prompt_records()
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "rewards.py").write_text(REWARDS_PY)
    (root / "broken.py").write_text("def score(prompts, responses:\n    return []\n")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    return dict(root=root, tok=str(root / "tok"), prompts=str(root / "prompts.jsonl"),
                rewards=str(root / "rewards.py"), broken=str(root / "broken.py"),
                records={r["prompt"]: r for r in records}, dot=tok.convert_tokens_to_ids("."))


def _args(inputs, workdir, *overrides, iterations=ITERATIONS, function="words"):
    return (f"--config={GRPO}", f"--workdir={workdir}", f"--config.num_iterations={iterations}",
            "--config.checkpoint.every=2", "--config.measure_peak=false", *runs.ONE_EPOCH,
            "--config.tensorboard=false", "--config.reward.kind=function",
            f"--config.reward.function={inputs['rewards']}:{function}",
            f"--config.data.prompts_path={inputs['prompts']}",
            f"--config.data.tokenizer_path={inputs['tok']}", "--config.ppo.pad_token_id=1",
            f"--config.ppo.truncate_token={inputs['dot']}", "--config.ppo.truncate_after=0",
            f"--config.ppo.rollout_micro_batch_size={MICRO}", "--config.data.samples_every=1",
            "--config.data.samples_per_table=8", *overrides)


def _run(args, timeout=900, **env):
    return subprocess.run(runs.command("train_ppo.py", *args), cwd=runs.ROOT,
                          env=runs.env(DEVICES, **env), capture_output=True, text=True,
                          timeout=timeout)


def _start(args, log_path, **env):
    return subprocess.Popen(runs.command("train_ppo.py", *args), cwd=runs.ROOT,
                            env=runs.env(DEVICES, **env), stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, text=True)


def _calls(path):
    return [json.loads(line) for line in open(path)]


def _one_error_line(proc):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert proc.stderr.rstrip().splitlines()[-1] == errors[0]
    return errors[0]


def _snapshot(path, skip=("logs",)):
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        rel = os.path.relpath(dirpath, path)
        if rel.split(os.sep)[0] in skip:
            continue
        out[rel] = None
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.normpath(os.path.join(rel, name))] = f.read()
    return out


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    """One uninterrupted run whose reward function logs every call."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    log = workdir.parent / "calls.jsonl"
    proc = _run(_args(inputs, workdir), REWARD_LOG=str(log))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(workdir=workdir, calls=_calls(log))


# ------------------------------------------------------------------ exactness
@pytest.mark.slow
def test_the_scores_training_uses_are_the_functions_own(inputs, reference):
    calls, workdir = reference["calls"], reference["workdir"]
    # The launch's dry call: the first 4 prompt records (with metadata), empty responses.
    dry = calls[0]
    first = list(inputs["records"].values())[:4]
    assert dry["prompts"] == [r["prompt"] for r in first] and dry["responses"] == [""] * 4
    assert dry["metadata"] == {"answer": [r["answer"] for r in first],
                               "difficulty": [r["difficulty"] for r in first]}
    # Then one call per rollout micro-batch: 2 per iteration, 32 rows each (this
    # process holds all 8 devices).
    training = calls[1:]
    assert len(training) == 2 * ITERATIONS
    assert all(len(c["responses"]) == BATCH // 2 for c in training)
    metrics = runs.strict_lines(workdir / "metrics.jsonl")
    samples = [json.loads(line) for line in open(workdir / "samples.jsonl")]
    assert len(metrics) == ITERATIONS and len(samples) == 8 * ITERATIONS
    for it in range(ITERATIONS):
        pair = training[2 * it: 2 * it + 2]
        penalised = []
        for call in pair:
            for prompt, response, score, answer, difficulty in zip(
                    call["prompts"], call["responses"], call["scores"],
                    call["metadata"]["answer"], call["metadata"]["difficulty"]):
                # Each row carries its own prompt record.
                record = inputs["records"][prompt]
                assert (answer, difficulty) == (record["answer"], record["difficulty"])
                # The response is cut after its first stop token ("."), as the reward
                # model would see it; one without a stop gets the missing-stop penalty.
                assert "." not in response.split()[:-1], response
                penalised.append(score if response.endswith(".") else -1.0)
            # The 4 samples of a prompt are contiguous rows (one group per device).
            for k in range(0, len(call["prompts"]), G):
                assert len(set(call["prompts"][k:k + G])) == 1
        assert metrics[it]["objective/scores"] == np.float32(np.mean(penalised)), it
        assert metrics[it]["time/reward_s"] > 0
        # The sample table's first 8 episodes: rows 0-3 are in the first call, 4-7 in the
        # second (CALL_ROWS), with their scores and metadata.
        table = samples[8 * it: 8 * it + 8]
        for row, line in enumerate(table):
            call, k = pair[row // 4], row % 4
            assert line["iteration"] == it + 1
            assert line["prompt"] == call["prompts"][k]
            assert line["score"] == penalised[(row // 4) * 32 + k]
            assert line["metadata"] == {"answer": call["metadata"]["answer"][k],
                                        "difficulty": call["metadata"]["difficulty"][k]}



@pytest.mark.slow
def test_evaluate_scores_held_out_prompts_with_the_function(inputs, reference, tmp_path):
    """pjit-ppo-evaluate on a run with a function reward: the policy's and the reference's
    samples are scored by the same function on the host (one call each, every held-out
    row with its own prompt record), eval.json's means are those scores with the
    missing-stop penalty, and samples.jsonl carries each row's metadata."""
    args = [a for a in _args(inputs, reference["workdir"]) if not a.startswith(
        ("--config.num_iterations", "--config.checkpoint.every"))]
    log = tmp_path / "eval_calls.jsonl"
    proc = subprocess.run(runs.command("evaluate.py", *args, "--config.evaluation.num_prompts=16",
                                       "--config.evaluation.greedy=true"),
                          cwd=runs.ROOT, env=runs.env(DEVICES, REWARD_LOG=str(log)),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = reference["workdir"] / "eval" / str(ITERATIONS)
    result = json.loads((out / "eval.json").read_text())
    rows = [json.loads(line) for line in open(out / "samples.jsonl")]
    policy_call, reference_call = _calls(log)  # one call per policy
    assert result["num_prompts"] == len(rows) == 16
    for call, key in ((policy_call, "policy"), (reference_call, "reference")):
        assert len(call["responses"]) == 16
        penalised = [s if r.endswith(".") else -1.0
                     for s, r in zip(call["scores"], call["responses"])]
        mean = result["reward_mean" if key == "policy" else "reference_reward_mean"]
        assert mean == pytest.approx(np.mean(penalised), abs=1e-6)
        for row, prompt, response, score, answer in zip(
                rows, call["prompts"], call["responses"], penalised, call["metadata"]["answer"]):
            assert row["prompt"] == prompt
            assert row[f"{key}_response"] == response
            assert row[f"{key}_reward"] == score
            record = inputs["records"][prompt]
            assert answer == record["answer"]
            assert row["metadata"] == {"answer": record["answer"],
                                       "difficulty": record["difficulty"]}

# ------------------------------------------------------------------ failures
@pytest.mark.slow
def test_a_failure_during_training_keeps_the_run_and_kill_9_continues_exactly(
        inputs, reference, tmp_path):
    """The function fails in iteration 3: exit 2, one line naming the function, the first
    failing row and its own message (first line only); checkpoint 2 and everything
    written before stay intact, and a rerun that fails again changes nothing. Once the
    function works, the same command trains on; kill -9 mid-run and the same command
    again finish exactly like the uninterrupted run: the same metrics and sample tables
    (with their prompt metadata), the remaining iterations scored as that run scored
    them."""
    workdir = tmp_path / "run"
    workdir.mkdir()  # an existing work directory (a fresh one is covered by the CLI)
    args = _args(inputs, workdir)
    log = tmp_path / "calls.jsonl"
    # Calls: 1 = the launch's dry call, 2-5 = iterations 1-2, 6 = iteration 3's first.
    proc = _run(args, REWARD_LOG=str(log), FAIL_AT_CALL="6", FAIL_MODE="raise")
    line = _one_error_line(proc)
    # The failing call (its rows were then tried one by one to find the first failing).
    failed = _calls(log)[5]["responses"]
    row = CALL_ROWS[0][next(i for i, r in enumerate(failed) if len(r.split()) >= 2)]
    for fragment in (f"reward.function='{inputs['rewards']}:words'",
                     "raised RuntimeError: the scoring service is unavailable",
                     f"at row {row} of iteration 3", "(prompt '"):
        assert fragment in line, (fragment, line)
    assert "retry in 5 minutes" not in proc.stderr
    from pjit_ppo import checkpoint
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]
    assert checkpoint.verify(str(workdir / "checkpoints" / "2")) is None
    assert runs.metric_lines(workdir) == 2
    before = _snapshot(workdir)
    logs_before = (workdir / "logs" / "process_0.log").read_bytes()

    # The same launch with a function that now returns inf in iteration 3 (the resumed
    # process's second call): stopped the same way; nothing written before changes.
    proc = _run(args, FAIL_AT_CALL="2", FAIL_MODE="inf")
    line = _one_error_line(proc)
    assert "returned inf as the score of row 0 of iteration 3" in line, line
    assert "resuming from checkpoint 2" in proc.stderr
    assert _snapshot(workdir) == before
    assert (workdir / "logs" / "process_0.log").read_bytes().startswith(logs_before)

    # The function works again: the same command resumes from checkpoint 2 and trains
    # on, until kill -9 after iteration 3's line.
    calls = tmp_path / "working_calls.jsonl"
    # Calls of this process: 1 = the dry call, 2-3 = iteration 3, 4 on = iteration 4 and
    # later, slowed so that the kill after iteration 3 comes before the run's end.
    proc = _start(args, tmp_path / "3.log", REWARD_LOG=str(calls), SLOW_FROM_CALL="4")
    runs.wait_for(lambda: runs.metric_lines(workdir) >= 3, proc=proc)
    runs.kill(proc)
    assert "resuming from checkpoint 2 " in (tmp_path / "3.log").read_text()
    # The same command again finishes exactly like the uninterrupted run.
    proc = _run(args, REWARD_LOG=str(calls))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 2, or 4 when the kill landed after that checkpoint was committed.
    start = int(re.search(r"resuming from checkpoint (\d+) ", proc.stderr).group(1))
    assert start in (2, 4), start
    runs.assert_same_metrics(reference["workdir"] / "metrics.jsonl", workdir / "metrics.jsonl")
    # The sample tables, with their prompt metadata, are those of the uninterrupted run.
    assert (workdir / "samples.jsonl").read_text() == (
        reference["workdir"] / "samples.jsonl").read_text()
    # The resumed process scored the remaining iterations as the uninterrupted run did.
    n = 2 * (ITERATIONS - start)
    assert _calls(calls)[-n:] == reference["calls"][-n:]


@dataclasses.dataclass(frozen=True)
class Case:
    """A launch whose reward function cannot work: the overrides (formatted with the
    input paths) and the fragments its one error line must contain."""
    id: str
    args: tuple
    expect: tuple


def _fn(name):
    return f"--config.reward.function={{rewards}}:{name}"


CASES = (
    Case("module_does_not_import", ("--config.reward.function=no_such_package_xyz.mod:score",),
         ("reward.function='no_such_package_xyz.mod:score'", "cannot import module",
          "ModuleNotFoundError", "No module named 'no_such_package_xyz'")),
    Case("file_missing", ("--config.reward.function={root}/nope.py:score",),
         ("nope.py:score'", "no such file")),
    Case("file_does_not_import", ("--config.reward.function={broken}:score",),
         ("broken.py:score'", "importing", "failed (SyntaxError")),
    Case("no_such_attribute", (_fn("scroe"),),
         ("has no attribute 'scroe'", "callables defined there", "words")),
    Case("not_callable", (_fn("NOT_CALLABLE"),), ("NOT_CALLABLE is a int, not a callable",)),
    Case("not_a_spec", ("--config.reward.function=score_responses",),
         ("reward.function='score_responses' is not a SPEC", "package.module:callable")),
    Case("wrong_signature", (_fn("one_arg"),),
         ("one_arg(responses) cannot be called as fn(prompts, responses, **metadata)",
          "metadata fields: answer, difficulty")),
    Case("raises", (_fn("raises_on_difficulty"),),
         ("raises_on_difficulty'", "raised KeyError: 'no rubric for difficulty 2'",
          "at row 2 of the launch check", "prompt 'the cat likes some bread'")),
    Case("wrong_count", (_fn("one_short"),), ("returned 3 scores for 4 rows",)),
    Case("not_a_number", (_fn("words_not_numbers"),),
         ("returned 'high' (str) as the score of row 0", "must be numbers")),
    Case("not_finite", (_fn("not_finite"),),
         ("returned nan as the score of row 1", "must be finite")),
    Case("not_a_sequence", (_fn("nothing"),), ("returned None (NoneType)", "not a sequence")),
    Case("function_term_fails", (
        "--config.reward.kind=terms", "--config.reward.function=",
        "--config.reward.terms=('acc:function:1.0:pjit_ppo.rewards.functions:exact_match', "
        "'bad:function:0.5:{rewards}:one_short')",),
         ("reward.terms[1] ('bad')", "returned 3 scores for 4 rows")),
    Case("unknown_term_kind", ("--config.reward.kind=terms", "--config.reward.function=",
                               "--config.reward.terms=('acc:functoin:1.0',)"),
         ("reward.terms[0]='acc:functoin:1.0'", "unknown kind 'functoin'")),
    Case("function_needs_text_prompts", ("--config.data.prompts_path=",),
         ("scores text", "data.prompts_path is empty")),
    Case("function_without_its_kind", ("--config.reward.kind=target_tokens",),
         ("reward.function=", "reward.kind='target_tokens' ignores it",
          "set reward.kind='function'")),
)


def _previous_run(path):
    (path / "checkpoints" / "2" / "policy").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"previous": "run"}))
    (path / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2}\n')
    (path / "checkpoints" / "2" / "policy" / "data").write_bytes(b"\x07" * 64)


def _launch(case, inputs, root):
    workdir = root / case.id / "run"
    _previous_run(workdir)
    before = _snapshot(workdir, skip=())
    fields = {k: v for k, v in inputs.items() if isinstance(v, (str, os.PathLike))}
    args = _args(inputs, workdir, *(a.format(**fields) for a in case.args))
    proc = subprocess.run(runs.command("train_ppo.py", *args), cwd=root / case.id,
                          env=runs.env(DEVICES, PJIT_PPO_MALLOC_TUNING="0"),
                          capture_output=True, text=True, timeout=600)
    return proc, before, _snapshot(workdir, skip=())


@pytest.fixture(scope="module")
def launches(inputs, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_functions")
    for case in CASES:
        (root / case.id).mkdir()
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {c.id: pool.submit(_launch, c, inputs, root) for c in CASES}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_function_that_cannot_work_is_refused_at_launch(case, launches):
    proc, before, after = launches[case.id]
    line = _one_error_line(proc)
    for fragment in case.expect:
        assert fragment in line, (fragment, line)
    assert "compil" not in proc.stderr  # refused before anything was compiled
    assert after == before, "a refused launch changed the earlier run's files"


# ------------------------------------------------------------------ in-process
def _tiny_run_config(**ppo):
    from pjit_ppo.config import ModelOptions, PPOConfig, RewardOptions, RunConfig
    base = dict(query_length=8, response_length=8, batch_size=32, samples_per_prompt=4,
                advantage_estimator="grpo", nminibatches=2, noptepochs=1, total_episodes=64,
                temperature=1.0, truncate_token=None, truncate_after=0, pad_token_id=63,
                rollout_micro_batch_size=16)
    base.update(ppo)
    return RunConfig(model=ModelOptions(random=tiny_text.model_random(vocab_size=64)),
                     reward=RewardOptions(kind="target_tokens", target_ids=(5, 6, 7)),
                     ppo=PPOConfig(**base), num_iterations=1, measure_peak=False)


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_split_rollout_computes_what_the_single_program_computes(lora_rank):
    """The same reward computed on the host (a Python function of the sampled tokens)
    instead of in the program: the same samples, scores, advantages and metrics; the
    host is called once per rollout micro-batch with this process's rows of it. With
    LoRA adapters (lora_rank 4) the sampling program reads them on their base."""
    from pjit_ppo.ppo import run as run_lib
    from pjit_ppo.ppo.trainer import PPOTrainer
    from pjit_ppo.rewards import HostFunction
    from pjit_ppo.rewards.function import HostScores
    config = _tiny_run_config(truncate_token=9, truncate_after=2)
    config.model.lora.rank = lora_rank
    job = run_lib.build(config)
    state = job.state
    if lora_rank:  # adapters away from zero, so that sampling without them would differ
        state = state._replace(params=jax.tree.map(lambda x: x + 0.3, state.params))
    whole = job.trainer
    models = dataclasses.replace(whole.models, reward_fn=HostScores(
        (HostFunction("never_imported:fn"),)))
    split = PPOTrainer(whole.cfg, models, whole.mesh, num_updates=1)
    calls = []

    def host_reward(iteration, rows, response, kept):  # the target_tokens rule, in numpy
        calls.append((iteration, list(rows)))
        hit = np.isin(response, [5, 6, 7]) & kept
        n = np.maximum(kept.sum(-1), 1)
        return (hit.sum(-1).astype(np.float32) / n.astype(np.float32))[:, None]
    split.host_reward = host_reward
    assert split.host_columns == 1 and whole.host_columns == 0
    query, mask = job.prompts(0)
    a, ma = whole.rollout(state, job.frozen, query, mask, 0)
    b, mb = split.rollout(state, job.frozen, query, mask, 0)
    # The first rollout compiles the rollout programs alone (the update is not needed).
    assert set(whole.compiled) == set(split.compiled) == {"rollout"}
    with pytest.raises(ValueError, match="choose one or more of"):
        whole.lower(state, job.frozen, query, mask, phases=("sample",))
    if lora_rank:  # the adapters are read: the policy is not the reference
        assert float(np.abs(np.asarray(a.logprobs - a.ref_logprobs)).max()) > 1e-3
    # Micro-batch c: the c-th 2 of each device's 4 rows.
    assert calls == [(0, [d * 4 + c * 2 + k for d in range(8) for k in range(2)])
                     for c in range(2)]
    for name, x, y in zip(a._fields, a, b):
        if x is None:
            assert y is None, name
            continue
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(x, y, err_msg=name)
    np.testing.assert_array_equal(np.asarray(a.scores), np.asarray(b.scores))
    ma, mb = jax.device_get((ma, mb))
    assert ma.keys() == mb.keys()
    for key in ma:
        np.testing.assert_allclose(ma[key], mb[key], rtol=1e-6, atol=1e-6, err_msg=key)
    # The planner reads the split rollout as one phase: the larger of its two programs.
    def fields(m):
        return (m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes)
    programs = split.compiled["rollout"]
    assert fields(programs.memory_analysis()) in (fields(programs.sample.memory_analysis()),
                                                  fields(programs.score.memory_analysis()))


def test_weighted_terms_and_their_metrics():
    """reward.kind="terms": the score is sum(weight x term), each term's mean is logged
    as reward/<name>, device terms run in the program, function terms on the host."""
    import jax.numpy as jnp
    from pjit_ppo import param_makers, rewards, sharding
    from pjit_ppo.rewards.responses import score_responses
    config = _tiny_run_config()
    config.reward.kind = "terms"
    config.reward.terms = ("tt:target_tokens:2.0:5,6", "fn:function:-0.5:x.py:f",
                           "t7:target_tokens:0.25:7")
    config.data.prompts_path = "prompts.jsonl"
    config.validate()
    mesh = sharding.make_mesh(1, -1, 1)
    reward = rewards.build(config, param_makers.Loaded(mesh))
    fn = reward.fn
    assert fn.names == ("tt", "fn", "t7") and fn.weights == (2.0, -0.5, 0.25)
    assert [(f.spec, f.field) for f in rewards.host_functions(fn)] == [
        ("x.py:f", "reward.terms[1] ('fn')")]
    assert rewards.function_specs(config) == (("reward.terms[1] ('fn')", "x.py:f"),)
    assert reward.params == {"tt": None, "fn": None, "t7": None} and reward.flops == 0
    response = jnp.array([[5, 6, 7, 9], [9, 9, 9, 9]], jnp.int32)
    query = jnp.zeros((2, 3), jnp.int32)
    host = jnp.array([[1.0], [3.0]], jnp.float32)
    scores, found, kept, terms = score_responses(config.ppo, fn, reward.params, query,
                                                 jnp.ones((2, 3), bool), response, host)
    np.testing.assert_allclose(np.asarray(terms), [[0.5, 1.0, 0.25], [0.0, 3.0, 0.0]])
    np.testing.assert_allclose(np.asarray(scores), [2 * 0.5 - 0.5 + 0.25 * 0.25, -1.5])
    with pytest.raises(ValueError, match="runs on the host"):
        score_responses(config.ppo, fn, reward.params, query, jnp.ones((2, 3), bool), response)
    assert "tt (x 2): target_tokens [5, 6]" in rewards.describe(config)


@pytest.mark.slow
def test_the_planner_plans_a_run_with_function_terms():
    """A function term has no device parameters: the planner assembles and compiles the
    split rollout (nothing imported or called) beside a reward model term."""
    from pjit_ppo import planning
    config = _tiny_run_config(advantage_estimator="gae", samples_per_prompt=1,
                              critic_init="reward", rollout_micro_batch_size=0)
    config.reward.kind = "terms"
    config.reward.terms = ("rm:model:1.0", "fmt:function:0.5:not_imported_by_the_planner:f")
    config.data.prompts_path = "prompts.jsonl"
    plan = planning.plan(config)
    rollout = plan["phases"]["rollout"]
    assert rollout["peak_bytes"] > 0 and rollout["breakdown"]["frozen_models"]["reward"] > 0
    assert plan["phases"]["update"]["breakdown"]["parameters"]["critic"] > 0
    run = planning.abstract_run(config, jax.make_mesh((1, 8, 1), ("data", "fsdp", "tensor")))
    assert run.trainer.host_columns == 1 and run.reward_model is not None


# ------------------------------------------------------------------ GRPO, built-ins
DIGIT_WORDS = ("the", "answer", "is", "what", "plus", "minus", "say", ".") + tuple(
    str(d) for d in range(10))


def _save_digit_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(("[UNK]", "<pad>", "<eos>") + DIGIT_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<pad>",
                            eos_token="<eos>").save_pretrained(directory)


@pytest.mark.slow
def test_grpo_learns_with_the_built_in_exact_match_and_format_terms(tmp_path):
    """GRPO on text prompts with an `answer` field, rewarded by the built-ins named as
    SPECs: exact match of the last number against the answer (1.0) plus a format bonus
    for "the answer is N" (0.5). Both terms are logged and the score is their weighted
    sum; the exact-match reward rises well above where it starts."""
    _save_digit_tokenizer(str(tmp_path / "tok"))
    rng = np.random.default_rng(0)
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for _ in range(64):
            a = int(rng.integers(0, 10))
            f.write(json.dumps({"prompt": f"say {a} .", "answer": str(a)}) + "\n")
    workdir = tmp_path / "run"
    iterations = 40
    proc = subprocess.run(runs.command(
        "train_ppo.py", f"--config={GRPO}", f"--workdir={workdir}",
        f"--config.num_iterations={iterations}", "--config.measure_peak=false",
        "--config.tensorboard=false", "--config.checkpoint.every=100",
        "--config.reward.kind=terms",
        "--config.reward.terms=('exact:function:1.0:pjit_ppo.rewards.functions:"
        "exact_match_last_number', 'fmt:function:0.5:pjit_ppo.rewards.functions:format_check')",
        f"--config.data.prompts_path={tmp_path / 'prompts.jsonl'}",
        f"--config.data.tokenizer_path={tmp_path / 'tok'}", "--config.ppo.pad_token_id=1",
        "--config.ppo.response_length=4", "--config.data.samples_every=10"),
        # One device: what is learned is the point, not sharding (the same numbers).
        cwd=runs.ROOT, env=runs.env(1), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = runs.strict_lines(workdir / "metrics.jsonl")
    assert len(metrics) == iterations
    for m in metrics:
        assert m["objective/scores"] == np.float32(
            np.float32(m["reward/exact"]) + np.float32(0.5) * np.float32(m["reward/fmt"]))
        assert 0 <= m["reward/exact"] <= 1 and 0 <= m["reward/fmt"] <= 1
    # About 0.06 over the first 10 iterations and 0.33 over the last 10 (measured once).
    first = np.mean([m["reward/exact"] for m in metrics[:10]])
    last = np.mean([m["reward/exact"] for m in metrics[-10:]])
    assert last > first + 0.15, (first, last)
    samples = [json.loads(line) for line in open(workdir / "samples.jsonl")]
    assert all(s["metadata"]["answer"] == s["prompt"].split()[1] for s in samples)
