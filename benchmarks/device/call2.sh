#!/usr/bin/env bash
# The device plan's second call (docs/performance.md, "The device plan"), only while the machine is still warm from
# the first: carry [".whl", ".gguf/b", ".gguf/sha256"], timeout_s 240. The real SmolLM2-135M-Instruct's rows, then
# held-out reward after equal completions.
set -o pipefail
# The first call kept part a in the working tree's copy (.device-keep/, git-ignored): there only while warm.
test -f .device-keep/gguf.a || { echo "part a gone: the machine was not warm since the first call; run it again"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 9
g=.device-keep/SmolLM2-135M-Instruct.Q4_1.gguf
cat .device-keep/gguf.a .gguf/b > "$g" && echo "$(cat .gguf/sha256)  $g" | sha256sum -c - || exit 4
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_rows.py --no-gate --no-tests --lengths '' --scale '' --gguf "$g" \
  --budget-s 170 --out "$OUT" ${GPU_ROWS_ARGS:-} 2>&1 | tee "$OUT/log2.txt"
