#!/usr/bin/env bash
# The device plan's first call (docs/performance.md, "The device plan"): carry [".whl", ".gguf/a"], timeout_s 400.
# Self-sufficient: installs the carried wheels beside the GPU image's packages, keeps the GGUF's first half for a
# second call, then runs benchmarks/gpu_rows.py (the gate first; every row the targets read).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 9
keep="${GRPO_DEVICE_KEEP:-$HOME/.cache/grpo-device-keep}"  # outlives this call while the machine stays warm
mkdir -p "$keep" && cp .gguf/a "$keep/gguf.a"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_rows.py --out "$OUT" 2>&1 | tee "$OUT/log1.txt"
