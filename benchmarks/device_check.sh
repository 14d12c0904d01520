#!/usr/bin/env bash
# One prepared GPU check, under 8 minutes on one H100/H200-class GPU: the PPO
# iteration benchmark at GPT-2-124M scale with the reference batch (512), bf16
# compute, printing seconds per iteration (rollout / update) and MFU.
#
# It uses the machine's own python3 and its CUDA jax. Pure-Python packages the
# image may lack (dm-haiku, ml-collections, tensorboardX) travel as wheels in
# .whl/ (for a machine without internet, see WORKSPACE.md); without .whl/ it falls back to pip.
# Usage, from the repo root on the GPU machine: bash benchmarks/device_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  python3 -m pip install -q -e . || true
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
# 512 episodes as 4 micro-batches of 128 keeps the update's activations modest.
timeout 420 python3 benchmarks/ppo_iteration.py --preset gpt2_124m --batch_size 512 \
    --grad_accum 4 --dtype bfloat16 --iterations 3
