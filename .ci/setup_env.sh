#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
source .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet torch==2.14.1 torchvision==0.29.1
python -m pip install --quiet "$(grep -o '"deepspeed[^"]*"' pyproject.toml | tr -d '"')"
for op in CPUAdamBuilder ShareMemCommBuilder; do
  DS_ACCELERATOR=cpu python .ci/build_deepspeed_ops.py "$op" >/tmp/setup/$op.log 2>&1 &
done
python -m pip install --quiet -e ".[dev]"
wait
echo SETUP DONE
