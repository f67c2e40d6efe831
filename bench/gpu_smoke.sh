#!/usr/bin/env bash
# The GPU smoke test, in one command, on whatever GPUs this machine has:
#   bench/gpu_smoke.sh [results file, default bench/results/gpu_smoke-<host>.md]
# Runs the real-GPU tests (tests/test_gpu.py: data parallel, ZeRO-3 with offload, and with 2 or more
# GPUs tensor and pipeline parallel; predicted against measured peaks) and, with 2 or more GPUs,
# the planner-accuracy benchmark on GPU workers. What needs more GPUs than there are is skipped
# and says so. Run it from a checkout installed as the README says.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results/gpu_smoke-$(hostname).md}"
gpus=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -eq 0 ]; then
  echo "no CUDA GPU visible to torch: nothing to run" >&2
  exit 2
fi
memory=$(python -c "import torch; print(round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2))")
work=$(mktemp -d)
{
  echo "# GPU smoke test"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'), host $(hostname)"
  echo "- GPUs: $gpus x $(python -c "import torch; print(torch.cuda.get_device_name(0))") (${memory} GiB)"
  echo "- $(python -c "import torch, deepspeed, ray; print(f'torch {torch.__version__}, DeepSpeed {deepspeed.__version__}, Ray {ray.__version__}')")"
  echo
  echo "## tests/test_gpu.py"
  echo
  echo '```'
} > "$out"
python -m pytest -m gpu tests/test_gpu.py -v -rs -p no:cacheprovider 2>&1 | tail -40 >> "$out"
tests_status=${PIPESTATUS[0]}
echo '```' >> "$out"
bench_status=0
if [ "$gpus" -ge 2 ]; then
  echo >> "$out"
  echo "## bench/memory_accuracy.py on GPU workers (4-worker plans with 4 or more GPUs)" >> "$out"
  echo >> "$out"
  python -m bench.memory_accuracy --markdown "$work/accuracy.md" cluster.accelerator=gpu \
    "cluster.device_memory_gib=$memory" > "$work/accuracy.log" 2>&1
  bench_status=$?
  if [ "$bench_status" -eq 0 ]; then cat "$work/accuracy.md" >> "$out"; else tail -40 "$work/accuracy.log" >> "$out"; fi
else
  echo >> "$out"
  echo "The planner-accuracy benchmark needs 2 GPUs (its plans are data parallel): skipped on 1." >> "$out"
fi
echo "results written to $out"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
