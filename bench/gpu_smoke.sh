#!/usr/bin/env bash
# The GPU smoke test, in one command, on whatever GPUs this machine has:
#   bench/gpu_smoke.sh [results file, default bench/results/gpu_smoke-<gpu>.md]
#   bench/gpu_smoke.sh --dry-run     # what it would run (no GPU needed)
# On any GPU: the one-GPU check (bench/gpu_check.py: ~1B-parameter GPT and Llama under `orch train`,
# ZeRO 0/2/3, offload, activation checkpointing, predicted against measured peak and step time, MFU,
# `orch export`), within GPU_CHECK_BUDGET_S seconds (default 330). With 2 or more GPUs also what needs
# several: tests/test_gpu.py (data parallel over NCCL, tp, pp) and the planner-accuracy benchmark on
# GPU workers. Run it from a checkout, with orch installed as the README or docs/gpu.md says.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--dry-run" ]; then
  exec python3 -m bench.gpu_check --dry-run
fi
gpus=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -eq 0 ]; then
  echo "no CUDA GPU visible to torch: nothing to run (--dry-run shows what would)" >&2
  exit 2
fi
gpu=$(python3 -c "import re, torch; print(re.sub(r'[^a-z0-9]+', '-', torch.cuda.get_device_name(0).lower()).strip('-'))")
out="${1:-bench/results/gpu_smoke-$gpu.md}"
memory=$(python3 -c "import torch; print(round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2))")
# GPU_CHECK_ARGS: more options for it, e.g. --only CASE... --case-timeout-s S.
# shellcheck disable=SC2086
python3 -m bench.gpu_check --markdown "$out" --budget-s "${GPU_CHECK_BUDGET_S:-330}" ${GPU_CHECK_ARGS:-}
check_status=$?
multi_status=0
echo >> "$out"
if [ "$gpus" -ge 2 ]; then
  work=$(mktemp -d)
  {
    echo "## tests/test_gpu.py ($gpus GPUs)"
    echo
    echo '```'
  } >> "$out"
  python3 -m pytest -m gpu tests/test_gpu.py -v -rs -p no:cacheprovider 2>&1 | tail -40 >> "$out"
  multi_status=${PIPESTATUS[0]}
  echo '```' >> "$out"
  echo >> "$out"
  echo "## bench/memory_accuracy.py on GPU workers (4-worker plans with 4 or more GPUs)" >> "$out"
  echo >> "$out"
  if python3 -m bench.memory_accuracy --markdown "$work/accuracy.md" cluster.accelerator=gpu \
      "cluster.device_memory_gib=$memory" > "$work/accuracy.log" 2>&1; then
    cat "$work/accuracy.md" >> "$out"
  else
    multi_status=1
    tail -40 "$work/accuracy.log" >> "$out"
  fi
else
  echo "## Needs 2 or more GPUs: skipped on this machine's 1" >> "$out"
  echo >> "$out"
  echo "tests/test_gpu.py (data parallel across ranks over NCCL, tensor parallel tp=2, pipeline pp=2) and" >> "$out"
  echo "the planner-accuracy benchmark on GPU workers." >> "$out"
fi
echo "results written to $out"
[ "$check_status" -eq 0 ] && [ "$multi_status" -eq 0 ]
