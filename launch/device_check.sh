#!/usr/bin/env bash
# The checks to run when a GPU machine is at hand (never needed by CI): real kernel timings
# and host<->device bandwidth. Writes JSON to ${OUT:-/tmp/jaxkv-device} and prints a summary.
#   bash launch/device_check.sh
set -euo pipefail
out="${OUT:-/tmp/jaxkv-device}"
mkdir -p "$out"
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q -e ".[cuda12]"
py=.venv-gpu/bin/python
$py -c "import jax; print(jax.devices())"
# Decode and prefill of Llama-3-8B attention shapes: jnp vs jaxkv's Triton-form kernel.
timeout 300 $py launch/bench.py --suite=kernels --reps=5 --json_out="$out/kernels.json"
# Host tier vs a bare device_put to pinned host memory, and disk vs pread/pwrite.
timeout 300 $py launch/bench.py --suite=tiers --reps=5 --json_out="$out/tiers.json"
