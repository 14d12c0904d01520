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


def fake_cpu_devices(n: int) -> None:
    """Lets the CPU backend show n devices (must run before jax initialises a backend)."""
    flag = "--xla_force_host_platform_device_count"
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
    os.environ["XLA_FLAGS"] = " ".join(kept + [f"{flag}={n}"])


def plan_devices(n: int):
    """n devices of the default backend if it has them, else n (fake) CPU devices."""
    import jax
    devices = jax.devices()
    if n <= 0:
        return devices
    if len(devices) >= n:
        return devices[:n]
    return jax.devices("cpu")[:n]


def main(argv):
    common.no_extra_args(argv)
    from pjit_ppo import preflight
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
