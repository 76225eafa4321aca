#!/usr/bin/env bash
# The checks to run when a GPU machine is at hand, in under 10 minutes on one H200 with the
# install: the attention kernels (jnp vs jaxkv's Pallas kernel, decode and prefill), the
# tiers (HBM<->host GB/s vs device_put and the link's nominal rate), and the engine on a
# Llama-3.2-1B-shaped model with the host tier on. Writes ONE JSON,
# ${OUT:-/tmp/jaxkv-device}/device_check.json (layout: launch/device_check.py), whose
# `verdict` says whether `auto` may move to the kernel; prints a summary.
#   bash launch/device_check.sh              # venv .venv-gpu + pip install -e ".[cuda12]"
#   bash launch/device_check.sh --dry_run    # no install: ${PYTHON:-python3}, --quick steps on
#                                            # whatever backend is present (CPU in CI)
#   bash launch/device_check.sh --no_install # the full steps with ${PYTHON:-python3} as it is
#                                            # (an offline machine whose image has JAX for
#                                            # the GPU; carry the missing wheels)
# Every step runs under its own time limit (the whole process group is killed at the limit);
# a failing step is recorded (rc, the end of its stderr) and the next one runs. Exit status:
# 0 when every step passed, 1 otherwise. Offline machines: PIP_NO_INDEX=1
# PIP_FIND_LINKS=/path/to/wheels bash launch/device_check.sh.
set -uo pipefail

dry_run=0
no_install=0
for arg in "$@"; do
  case "$arg" in
    --dry_run) dry_run=1 ;;
    --no_install) no_install=1 ;;
    *) echo "error: unknown argument $arg; use --dry_run, --no_install or nothing." >&2; exit 2 ;;
  esac
done

out="${OUT:-/tmp/jaxkv-device}"
mkdir -p "$out/steps" 2>/dev/null && out=$(cd "$out" && pwd) || {
  echo "error: OUT=$out cannot be created; set OUT to a writable directory." >&2; exit 2; }
python="${PYTHON:-python3}"
[[ "$python" == */* && "$python" != /* ]] && python="$PWD/$python"  # before the cd below
cd "$(dirname "$0")/.."
steps="$out/steps"
rm -f "$steps"/* "$out/device_check.json"  # a stale file must never pass for this run's
t_start=$(date +%s.%N)
now() { date +%s.%N; }

# Step time limits (seconds). On an H200 the whole run must stay under 10 minutes:
# install 180 + devices 30 + kernels 120 + tiers 90 + engine 150 = 570, and a deadline
# at 580 s cuts a late step short (a step gets 10 s after its TERM before the KILL). A dry run (2 CPU cores) gets roomier limits, no deadline.
# STEP_LIMIT_S=N gives every step N seconds instead (tests).
if (( dry_run )); then
  declare -A budget=([devices]=60 [kernels]=180 [tiers]=180 [engine]=360)
  deadline_s=0
else
  declare -A budget=([install]=180 [devices]=30 [kernels]=120 [tiers]=90 [engine]=150)
  deadline_s=580
fi

failed=0
current=""  # pid of the running step's `timeout`
trap 'if [[ -n "$current" ]]; then kill -TERM "$current" 2>/dev/null; fi; exit 130' INT TERM

# step NAME COMMAND...: runs COMMAND under `timeout` (its own process group: at the limit
# TERM, 10 s later KILL, to every process of the step), stdout and stderr to files, and
# records rc, wall seconds, the limit and the command line in $steps/NAME.meta.
step() {
  local name=$1; shift
  local limit=${STEP_LIMIT_S:-${budget[$name]}} t0 rc
  t0=$(now)
  if (( deadline_s > 0 )); then
    local left
    left=$(awk -v s="$t_start" -v t="$t0" -v d="$deadline_s" 'BEGIN { printf "%d", s + d - t }')
    (( left < limit )) && limit=$left
  fi
  echo "== $name (limit ${limit} s): $*"
  if (( limit < 5 )); then
    echo "skipped: the 10-minute budget was spent before this step" >"$steps/$name.stderr"
    : >"$steps/$name.stdout"
    rc=124
  else
    timeout -k 10 "$limit" "$@" >"$steps/$name.stdout" 2>"$steps/$name.stderr" &
    current=$!
    wait "$current"
    rc=$?
    current=""
  fi
  local wall
  wall=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }')
  { echo "$rc"; echo "$wall"; echo "$limit"; printf '%q ' "$@"; echo; } >"$steps/$name.meta"
  echo "   rc $rc in $wall s"
  if (( rc != 0 )); then
    failed=1
    tail -n 5 "$steps/$name.stderr" | sed 's/^/   | /'
  fi
  return 0
}

install_s=""
if (( dry_run )); then
  py="$python"
  quick=(--quick --reps=1)
  # The embedded default (tiny model, CPU mesh), a workload that overflows its small device
  # pool so blocks go to the host tier and come back; one shape bucket to compile.
  engine=("$py" launch/serve.py --host_pages=64 --device_pages=8
          --config.engine.max_seqs_per_shard=1 --config.workload.chat.users=8
          --config.workload.chat.turns=2 --config.workload.chat.system_prompt_tokens=48
          "--config.workload.chat.user_tokens=(16, 32)"
          --config.workload.chat.max_new_tokens=4 --json_out="$steps/engine.json")
else
  if (( no_install )); then
    py="$python"
  else
    venv=.venv-gpu
    step install bash -c "'$python' -m venv '$venv' && '$venv/bin/pip' install -q -e '.[cuda12]'"
    install_s=$(awk 'NR == 2' "$steps/install.meta")
    py="$venv/bin/python"
  fi
  quick=(--reps=5)
  # Llama-3.2-1B shapes, random bf16 weights, host tier in pinned host memory. Up to 4
  # sequences at once and at most 512 tokens each (3 x 3 shape buckets to compile); 16
  # users over 128 device pages (64 MiB): turn 0 overflows the pool, so blocks go down
  # to the host tier and later turns fetch them back.
  engine=("$py" launch/serve.py --config=configs/llama3_2_1b_gpu.py --host_pages=4096
          --device_pages=128 --config.cache.max_pages_per_seq=32
          --config.engine.max_seqs_per_shard=4 --config.workload.chat.users=16
          --config.workload.chat.turns=3 --config.workload.chat.system_prompt_tokens=192
          "--config.workload.chat.user_tokens=(32, 64)"
          --config.workload.chat.max_new_tokens=24 --json_out="$steps/engine.json")
fi

step devices "$py" launch/device_check.py probe --json_out="$steps/devices.json"
cat "$steps/devices.stdout"
step kernels "$py" launch/bench.py --suite=kernels "${quick[@]}" --json_out="$steps/kernels.json"
step tiers "$py" launch/bench.py --suite=tiers "${quick[@]}" --json_out="$steps/tiers.json"
step engine "${engine[@]}"

# Merge with the step's python when it runs, else the one the venv was made from.
merge_py="$py"
"$merge_py" -c "" 2>/dev/null || merge_py="$python"
wall=$(awk -v a="$t_start" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }')
args=(launch/device_check.py merge --out_dir="$out" --wall_s="$wall")
(( dry_run )) && args+=(--dry_run)
(( no_install )) && args+=(--no_install)
[[ -n "$install_s" ]] && args+=(--install_s="$install_s")
"$merge_py" "${args[@]}"
merge_rc=$?
if (( merge_rc != 0 && merge_rc != 1 )); then
  echo "error: merging the steps failed (rc $merge_rc); the records are in $steps" >&2
  exit 1
fi
exit $(( failed || merge_rc ))
