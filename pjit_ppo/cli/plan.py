"""Memory planner entry point: `pjit-ppo-plan` or `python launch/plan.py`.

  pjit-ppo-plan --config=configs/gptj_6b.py --devices=8 --device_memory=40GB
  pjit-ppo-plan --config=configs/gptj_6b.py:grpo --devices=8 --format=json

Compiles the rollout and the update ahead of time on abstract shapes (nothing is
allocated) for `--devices` devices and prints, per device and per phase, XLA's memory
analysis, the peak (every buffer resident during the phase), an analytic breakdown,
whether it fits `--device_memory`, and the largest micro-batch of each phase that fits.
Without enough accelerators (e.g. on a laptop) it plans on `--devices` fake CPU
devices, which it creates itself before jax starts.
"""
import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from pjit_ppo.cli import common, flag_errors

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (get_config).")
_DEVICES = flags.DEFINE_integer("devices", 0, "Devices to plan for (0 = all the default "
                                              "backend has).")
_MEMORY = flags.DEFINE_string("device_memory", "", "Memory of one device, e.g. 40GB or 32GiB "
                                                   "('' = what the backend reports, if any).")
_FORMAT = flags.DEFINE_enum("format", "text", ["text", "json"], "Output format.")
_SEARCH = flags.DEFINE_bool("search", True, "Also find the largest micro-batch of each phase "
                                            "that fits (compiles each phase a few more times).")
flags.mark_flags_as_required(["config"])


#: XLA passes the planner turns off when it plans on CPU devices. XLA:CPU has no bf16
#: matmul: it converts bf16 operands to f32, and these passes hoist the conversion of
#: every layer's weights out of the layer loop, a float32 copy of all the bf16 weights
#: (48 of the 113 GiB Llama-2-7B's LoRA GRPO rollout would otherwise plan) that an
#: accelerator, which multiplies bf16 natively, never allocates.
CPU_ONLY_HOISTING = ("while-loop-invariant-code-motion",
                     "while-loop-expensive-invariant-code-motion")


def fake_cpu_devices(n: int) -> None:
    """Lets the CPU backend show n devices and plan as an accelerator would (see
    CPU_ONLY_HOISTING); must run before jax initialises a backend."""
    flag, passes = "--xla_force_host_platform_device_count", "--xla_disable_hlo_passes"
    flags_now = os.environ.get("XLA_FLAGS", "").split()
    disabled = [p for f in flags_now if f.startswith(passes + "=")
                for p in f.split("=", 1)[1].split(",") if p]
    kept = [f for f in flags_now if not f.startswith(flag) and not f.startswith(passes)]
    disabled += [p for p in CPU_ONLY_HOISTING if p not in disabled]
    os.environ["XLA_FLAGS"] = " ".join(kept + [f"{flag}={n}", f"{passes}={','.join(disabled)}"])


def plan_devices(n: int):
    """n devices of the default backend if it has them, else n (fake) CPU devices."""
    import jax
    devices = jax.devices()
    if n <= 0:
        return devices
    if len(devices) >= n:
        return devices[:n]
    return jax.devices("cpu")[:n]


def plan_shapes_without_downloads(config) -> list:
    """A recipe whose model files are none of them here (not downloaded yet), and which
    gives their shape in model.random, is planned on that shape: planning is what one
    does before a download. Clears those paths in `config` (in place) and returns a note
    per path. When any of them is here the user pointed at their own files, and a missing
    one is their mistake: nothing changes and the launch checks name it."""
    if not config.model.random:
        return []
    fields = [(options, field, getattr(options, field))
              for options, field in ((config.model, "policy_path"), (config.reward, "path"))
              if getattr(options, field)]
    if not fields or any(os.path.exists(path) for _, _, path in fields):
        return []
    notes = []
    for options, field, path in fields:
        setattr(options, field, "")
        section = "model" if options is config.model else "reward"
        notes.append(f"note: {section}.{field}={path!r} is not here: planning the shape in "
                     f"model.random (the recipe's) instead")
    config.reward.allow_random_head = True  # the policy's shape with a head: shapes suffice
    if config.data.tokenizer_path and not os.path.exists(config.data.tokenizer_path):
        config.data.tokenizer_path = ""
    return notes


def main(argv):
    common.no_extra_args(argv)
    from pjit_ppo import preflight
    for note in plan_shapes_without_downloads(_CONFIG.value):
        print(note, file=sys.stderr)
    with common.config_errors():  # the launch checks of training, before jax: one line, exit 2
        preflight.check_plan(_CONFIG.value)
    if _DEVICES.value > 0:
        fake_cpu_devices(_DEVICES.value)
    common.setup_jax()
    from pjit_ppo import planning, sharding
    from pjit_ppo.config import ConfigError
    from pjit_ppo.loading import device_memory_limit
    with common.user_errors():
        config = _CONFIG.value
        config.validate()
        try:
            memory = (planning.parse_bytes(_MEMORY.value) if _MEMORY.value
                      else device_memory_limit())
        except ValueError as e:
            raise ConfigError(f"--device_memory: {e}") from None
        devices = plan_devices(_DEVICES.value)
        if _DEVICES.value and len(devices) < _DEVICES.value:
            raise ConfigError(f"--devices={_DEVICES.value}: only {len(devices)} devices could "
                              f"be created; set XLA_FLAGS before starting or plan for fewer")
        try:
            mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor,
                                      devices=devices)
        except sharding.ShardingError as e:
            raise ConfigError(f"mesh: {e}") from None
        result = planning.plan(config, memory, mesh=mesh, search=_SEARCH.value)
    if _FORMAT.value == "json":
        json.dump(planning.to_json_ready(result), sys.stdout, indent=2)
        print()
    else:
        print(planning.to_text(result))


def run_main():
    """The console script."""
    app.run(main, flags_parser=flag_errors.parse_flags)
