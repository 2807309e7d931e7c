#!/usr/bin/env bash
# The device plan's second call (docs/performance.md, "The device plan"), only while the machine is still warm from
# the first: carry [".whl", ".gguf/b", ".gguf/sha256"], timeout_s 240. The real SmolLM2-135M-Instruct's rows, then
# held-out reward after equal completions.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 9
keep="${GRPO_DEVICE_KEEP:-$HOME/.cache/grpo-device-keep}"  # where the first call kept part a
test -f "$keep/gguf.a" || { echo "part a gone: the machine was not warm"; exit 3; }
g=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
cat "$keep/gguf.a" .gguf/b > "$g" && echo "$(cat .gguf/sha256)  $g" | sha256sum -c - || exit 4
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_rows.py --no-gate --no-tests --lengths '' --scale '' --gguf "$g" \
  --budget-s 170 --out "$OUT" 2>&1 | tee "$OUT/log2.txt"
