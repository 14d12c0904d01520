"""A newcomer's own HF model run through configs/hf_model.py with no override but the model
and the prompts, made once per pytest session and shared by the tests that check it.

test_hf_model_recipe's gpt2 case and test_newcomer_defects's tests check the same run (a
GPT-2-architecture directory of the newcomer's own: a word-level tokenizer, a
generation_config.json, 24 prompts). Whichever test asks first makes it, in a directory
of the session's base temporary directory shared by the xdist workers, under a file
lock; the others reuse it. A run that failed is shared too (its exit status and stderr):
every test that uses it then fails with the run's own message.
"""
import fcntl
import json
import os
import shutil
import types

import runs
import tiny_hf
import tiny_text

RECIPE = os.path.join(runs.ROOT, "configs", "hf_model.py")
GENERATION_CONFIG = {"do_sample": True, "temperature": 0.6}
NUM_PROMPTS, PROMPTS_SEED = 24, 5


def _session_dir(tmp_path_factory):
    """The session's base temporary directory: under xdist each worker's basetemp is a
    `popen-gwN` directory of the controller's, which all workers share."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def own_run(tmp_path_factory, family: str, **overrides) -> dict:
    """{root, model, prompts, workdir, args (the run's --config flags), proc (returncode,
    stderr)} of `train_ppo.py --config=configs/hf_model.py --config.model.policy_path=MODEL
    --config.data.prompts_path=PROMPTS --workdir=WORKDIR` on a tiny random `family` model
    (tiny_hf.save_model overrides), run once per session."""
    key = family + "".join(f"_{k}={v}" for k, v in sorted(overrides.items()))
    root = _session_dir(tmp_path_factory) / f"own_model_run_{key}"
    root.mkdir(exist_ok=True)
    model, prompts, workdir = root / "my_model", root / "prompts.jsonl", root / "run"
    args = (f"--config={RECIPE}", f"--config.model.policy_path={model}",
            f"--config.data.prompts_path={prompts}")
    result = root / "result.json"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
        if not result.exists():
            shutil.rmtree(workdir, ignore_errors=True)  # an interrupted try's, if any
            tiny_hf.save_model(family, str(model), **overrides)
            tiny_text.save_tokenizer(str(model))
            (model / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
            prompts.write_text("".join(json.dumps({"prompt": s}) + "\n" for s in
                                       tiny_text.sentences(NUM_PROMPTS, seed=PROMPTS_SEED)))
            proc = runs.run("train_ppo.py", *args, f"--workdir={workdir}", timeout=900)
            result.write_text(json.dumps({"returncode": proc.returncode,
                                          "stderr": proc.stderr}))
    proc = types.SimpleNamespace(**json.loads(result.read_text()))
    return dict(root=root, model=model, prompts=prompts, workdir=workdir, args=args,
                proc=proc)
