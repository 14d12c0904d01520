"""Export entry point: `pjit-ppo-export` or `python launch/export_hf.py`.

  pjit-ppo-export --workdir=DIR --output=OUT [--step=N] [--adapters_only]

Writes the policy of checkpoint N (latest complete by default) to OUT as an HF model
directory (config.json + safetensors) that transformers loads. A run with LoRA adapters
(model.lora.rank > 0): the adapters merged into the base model; with --adapters_only the
adapters alone as a PEFT directory (adapter_config.json + adapter_model.safetensors) that
peft.PeftModel.from_pretrained loads onto the base model.
"""
from absl import app, flags, logging

from pjit_ppo.cli import common, flag_errors

_WORKDIR = flags.DEFINE_string("workdir", None, "The run directory holding checkpoints/.")
_OUTPUT = flags.DEFINE_string("output", None, "Directory to write the HF model to.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint iteration (default: latest complete).")
_ADAPTERS_ONLY = flags.DEFINE_bool(
    "adapters_only", False, "A run with LoRA adapters: write the adapters alone as a PEFT "
    "adapter directory instead of the merged model.")
flags.mark_flags_as_required(["workdir", "output"])


def main(argv):
    common.no_extra_args(argv)
    from pjit_ppo import preflight
    with common.config_errors():  # a run directory to read, an output directory to write
        preflight.check_export(_WORKDIR.value, _OUTPUT.value)
    common.setup_jax()
    from pjit_ppo import export
    with common.user_errors():
        step, path = export.export_policy(_WORKDIR.value, _OUTPUT.value, _STEP.value,
                                          adapters_only=_ADAPTERS_ONLY.value)
    logging.info("exported the policy of checkpoint %d to %s", step, path)


def run_main():
    common.tune_cpu_malloc()
    app.run(main, flags_parser=flag_errors.parse_flags)
