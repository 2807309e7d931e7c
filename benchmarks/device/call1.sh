#!/usr/bin/env bash
# The device plan's first call (docs/performance.md, "The device plan"): carry [".whl", ".gguf/a"], timeout_s 400.
# Self-sufficient: installs the carried wheels beside the GPU image's packages, keeps the GGUF's first half for a
# second call, then runs benchmarks/gpu_rows.py (the gate first; every row the targets read).
set -o pipefail
# The image's own packages, before anything is installed beside them: what a pipeline run on this machine would have
# to bring (Prefect, MLflow, DVC, Great Expectations and their dependencies, as Python 3.12 wheels).
python3 -m pip list --format=json > "$OUT/image_packages.json" 2>/dev/null || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 9
# Kept in the working tree's copy, git-ignored and not carried: the device keeps it for the next call while warm.
mkdir -p .device-keep && cp .gguf/a .device-keep/gguf.a || exit 9
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# GPU_ROWS_ARGS (for example "--budget-s 60") cuts the rows short: the gate and the kept half still run.
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_rows.py --out "$OUT" ${GPU_ROWS_ARGS:-} 2>&1 | tee "$OUT/log1.txt"
