"""Export a checkpoint's policy to an HF directory (the same as `pjit-ppo-export`).

  python launch/export_hf.py --workdir=DIR --output=OUT [--step=N]
"""
from pjit_ppo.cli import export_hf

if __name__ == "__main__":
    export_hf.run_main()
