"""The program cache (pjit_ppo.program_cache): a repeated launch loads its PPO phases and
its random model's init without tracing them and computes the same bit for bit; a
damaged entry is compiled (or traced) again with a warning; what the key leaves out (the run length) does not change the program, and
what it holds (a config field) does; a miss is compiled by XLA even when JAX's own
persistent cache holds the program (a copy of what that cache gives back fails when run),
and the stored program runs."""
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pjit_ppo import program_cache

import runs

sys.path.insert(0, os.path.join(runs.ROOT, "configs"))
import tiny_demo  # noqa: E402  (configs/tiny_demo.py)

LOADED = "program cache: loaded "


def _launch(workdir, programs, iterations=2):
    """train_ppo.py on the tiny recipe with its own program cache (and the session's
    compilation cache, which a miss sets aside for the phases)."""
    args = runs.train_args(workdir, *runs.ONE_EPOCH, iterations=iterations, every=iterations)
    env = runs.env(PJIT_PPO_PROGRAM_CACHE_DIR=str(programs))
    return subprocess.run(runs.command("train_ppo.py", *args), cwd=runs.ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_repeated_launch_loads_its_programs_and_a_damaged_entry_is_compiled_again(tmp_path):
    programs = tmp_path / "programs"
    first = _launch(tmp_path / "first", programs)
    assert first.returncode == 0, first.stderr[-3000:]
    assert LOADED not in first.stderr
    entries = sorted(programs.glob("*.programs"))
    assert len(entries) == 3  # rollout, update, the policy's random init
    shapes = sorted(programs.glob("*.shapes"))
    assert len(shapes) == 1  # the policy's parameter shapes
    assert not list(programs.glob(".tmp-*"))

    again = _launch(tmp_path / "again", programs)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count(LOADED) == 3
    runs.assert_same_metrics(tmp_path / "first" / "metrics.jsonl",
                             tmp_path / "again" / "metrics.jsonl")

    for entry in entries + shapes:  # cut off, as by a full disk
        entry.write_bytes(entry.read_bytes()[:100])
    damaged = _launch(tmp_path / "damaged", programs)
    assert damaged.returncode == 0, damaged.stderr[-3000:]
    assert LOADED not in damaged.stderr
    assert damaged.stderr.count("program cache: cannot read ") == 4
    assert damaged.stderr.count("compiling instead") == 3
    assert damaged.stderr.count("tracing instead") == 1
    runs.assert_same_metrics(tmp_path / "first" / "metrics.jsonl",
                             tmp_path / "damaged" / "metrics.jsonl")
    # Written again, whole.
    assert sorted(programs.glob("*.programs")) == entries
    assert sorted(programs.glob("*.shapes")) == shapes
    assert all(entry.stat().st_size > 100 for entry in entries + shapes)
    assert runs.metric_lines(tmp_path / "first") == 2  # the earlier runs are untouched


def _tiny_trainer(**ppo_changes):
    from pjit_ppo import param_makers, sharding
    from pjit_ppo.ppo.assembly import assemble
    config = tiny_demo.get_config()
    for name, value in ppo_changes.items():
        setattr(config.ppo, name, value)
    make = param_makers.Abstract(sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    return assemble(config, make)


def test_the_key_leaves_out_the_run_length_and_nothing_that_changes_the_program():
    base = _tiny_trainer()
    longer = _tiny_trainer(total_episodes=base.trainer.cfg.total_episodes * 3)
    other = _tiny_trainer(cliprange=0.1)
    description = base.trainer.program_description()
    assert description is not None
    assert longer.trainer.program_description() == description
    assert other.trainer.program_description() != description
    query = jax.ShapeDtypeStruct((base.trainer.cfg.prompts_per_iteration,
                                  base.trainer.cfg.query_length), jnp.int32)
    mask = jax.ShapeDtypeStruct(query.shape, jnp.bool_)

    def update_text(assembly):
        lowered = assembly.trainer.lower(assembly.state, assembly.frozen, query, mask,
                                         phases=("rollout", "update"))
        return lowered["update"].as_text()
    # The length is an input of the update: the same program for any length.
    assert update_text(longer) == update_text(base)


def test_no_key_without_a_description_of_the_reward_or_with_an_optimizer_passed_in():
    import optax
    from pjit_ppo.ppo.trainer import PPOTrainer
    run = _tiny_trainer()
    trainer = run.trainer

    def plain_reward(params, query, query_mask, response, response_mask):
        return jnp.zeros(response.shape[:1], jnp.float32)
    no_key = dataclasses.replace(trainer.models, reward_fn=plain_reward)
    assert PPOTrainer(trainer.cfg, no_key, trainer.mesh,
                      num_updates=3).program_description() is None
    assert PPOTrainer(trainer.cfg, trainer.models, trainer.mesh, num_updates=3,
                      optimizer=optax.sgd(0.1)).program_description() is None


def test_a_miss_is_compiled_by_xla_even_when_jax_s_cache_holds_the_program(tmp_path,
                                                                           monkeypatch):
    """A copy of what JAX's persistent cache gives back does not serialize whole (its
    reloaded copy fails when run), so a miss compiles with that cache set aside; the
    stored program then runs, and JAX's cache is back on afterwards."""
    monkeypatch.setenv(program_cache.ENV, str(tmp_path))
    # A program no other test compiles: the first compile is XLA's own.
    marker = float(np.random.default_rng(os.getpid()).integers(1 << 20)) + 0.5

    def f(x):
        return jnp.argmax(jnp.sin(x) * marker) + jnp.sum(x > marker)
    x = jnp.arange(4.0)

    def compile_f():
        return [jax.jit(f).lower(x).compile()]
    (fresh,) = compile_f()  # into JAX's persistent cache
    jax.clear_caches()
    (compiled,) = program_cache.compile_and_store("a" * 64, compile_f)
    assert os.listdir(tmp_path) == ["a" * 64 + ".programs"]
    assert jax.config.jax_enable_compilation_cache
    (loaded,) = program_cache.load("a" * 64)
    np.testing.assert_array_equal(loaded(x), fresh(x))
    np.testing.assert_array_equal(compiled(x), fresh(x))
    # The guard behind the set-aside: should JAX's cache give the program back anyway,
    # nothing is stored.
    monkeypatch.setattr(program_cache, "_xla_compiles", contextlib.nullcontext)
    jax.clear_caches()
    (again,) = program_cache.compile_and_store("b" * 64, compile_f)
    np.testing.assert_array_equal(again(x), fresh(x))
    assert os.listdir(tmp_path) == ["a" * 64 + ".programs"]


def test_a_random_model_is_the_same_drawn_afresh_or_by_a_stored_init(tmp_path, monkeypatch,
                                                                     caplog):
    """loading.random_params: the first call stores the init program, a second loads it;
    both draw exactly what the plain init draws. program_cache.shapes keeps a traced
    tree and gives it back without calling its maker; a damaged file is traced again."""
    from pjit_ppo import loading, sharding
    from pjit_ppo.models import ModelConfig, init_params, param_shapes
    config = ModelConfig.from_hf_dict(dict(tiny_demo.get_config().model.random),
                                      n_layers=1, vocab_size=98)
    mesh = sharding.make_mesh(2, 2, 2)
    expected = jax.device_get(jax.jit(init_params, static_argnums=0)(
        config, jax.random.PRNGKey(3)))
    monkeypatch.setenv(program_cache.ENV, str(tmp_path))
    for loaded in (False, True):  # a miss (compiled, stored), then a hit (loaded)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            params = loading.random_params(config, mesh, 3)
        assert (LOADED in caplog.text) == loaded
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), expected)
        assert len(list(tmp_path.glob("*.programs"))) == 1
    want = sharding.param_shardings(param_shapes(config), mesh)
    assert jax.tree.map(lambda x: x.sharding, params) == want

    monkeypatch.setenv(program_cache.ENV, str(tmp_path / "shapes"))
    calls = []

    def make():
        calls.append(1)
        return jax.eval_shape(lambda: {"w": jnp.zeros((3, 5))})
    first = program_cache.shapes("test/shapes", "one", make)
    assert first == {"w": jax.ShapeDtypeStruct((3, 5), jnp.float32)}
    assert program_cache.shapes("test/shapes", "one", make) == first and len(calls) == 1
    (stored,) = (tmp_path / "shapes").glob("*.shapes")
    stored.write_bytes(b"\x80")  # damaged
    assert program_cache.shapes("test/shapes", "one", make) == first and len(calls) == 2
    assert program_cache.shapes("test/shapes", "two", make) == first and len(calls) == 3
    assert len(list((tmp_path / "shapes").glob("*.shapes"))) == 2


def test_a_supervised_step_with_a_description_is_stored_loaded_and_computes_the_same(
        tmp_path, monkeypatch, caplog):
    """supervised.make_train_step / make_eval_step with a description: the first step
    compiles and stores its program, a step made again from the same description loads
    it; both compute exactly what the plain jitted step computes (a LoRA-like frozen
    input and a dropout key included). Another description is another entry."""
    import optax
    from pjit_ppo import sharding, supervised
    mesh = sharding.make_mesh(2, 2, 2)

    def loss_fn(params, batch, frozen=None, key=None):
        w = params["w"] if frozen is None else params["w"] + frozen["w"]
        if key is not None:
            w = w * jax.random.bernoulli(key, 0.9, w.shape)
        err = batch["x"] @ w - batch["y"]
        return jnp.sum(err ** 2), {"loss": jnp.sum(err ** 2),
                                   "weight": jnp.float32(batch["x"].shape[0])}
    rng = np.random.default_rng(0)
    batch = supervised.put_batch(mesh, {"x": rng.normal(size=(2, 8, 4)).astype(np.float32),
                                        "y": rng.normal(size=(2, 8, 3)).astype(np.float32)},
                                 batch_dim=1)
    frozen = {"w": jnp.ones((4, 3))}
    optimizer = optax.adam(0.1)

    def fresh():
        params = {"w": jax.device_put(jnp.full((4, 3), 0.5), sharding.replicated(mesh))}
        return params, supervised.init_opt_state(optimizer, params, mesh)

    def three_steps(description, **kwargs):
        params, opt_state = fresh()
        step = supervised.make_train_step(loss_fn, optimizer, params, opt_state, mesh,
                                          description=description, **kwargs)
        key = (jax.random.PRNGKey(1),) if kwargs.get("keyed") else ()
        for _ in range(3):
            params, opt_state, metrics = step(params, opt_state, batch, *key)
        evaluate = supervised.make_eval_step(loss_fn, mesh, frozen=kwargs.get("frozen"),
                                             description=description)
        stats = evaluate(params, jax.tree.map(lambda x: x[0], batch))
        return jax.device_get((params, metrics, stats))

    monkeypatch.setenv(program_cache.ENV, str(tmp_path))

    def run(description, **kwargs):
        """three_steps' results, how many programs it loaded, and the entries after it."""
        caplog.clear()
        with caplog.at_level(logging.INFO):
            got = three_steps(description, **kwargs)
        return got, caplog.text.count(LOADED), len(list(tmp_path.glob("*.programs")))

    stored = 0
    for kwargs in ({}, {"frozen": frozen, "keyed": True}):
        expected = three_steps(None, **kwargs)  # no description: never stored
        assert len(list(tmp_path.glob("*.programs"))) == stored
        for loaded in (0, 2):  # compiled and stored, then loaded (step, evaluation)
            got, n_loaded, n_entries = run(f"toy {sorted(kwargs)}", **kwargs)
            assert (n_loaded, n_entries) == (loaded, stored + 2)
            jax.tree.map(np.testing.assert_array_equal, got, expected)
        stored += 2
    # Another description (say, another learning rate the optimizer closes over): compiled.
    got, n_loaded, n_entries = run("toy [] with another learning rate")
    assert (n_loaded, n_entries) == (0, stored + 2)
