#!/usr/bin/env bash
# After the first plan (generation below its target on the long row; a decode step as long at 256 rows as at 64):
# the decode step's distinct-index writes with and without deterministic mode's sorted path
# (benchmarks/device/index_writes_ab.py), then the gate and the 128-token long rows against TRL again.
# carry [".whl"], timeout_s 250.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 9
PYTHONUNBUFFERED=1 python3 benchmarks/device/index_writes_ab.py 2>&1 | grep -v Warning | tee "$OUT/ab.txt"
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_rows.py --no-tests --lengths 128 --scale '' --no-wide --no-eos-row \
  --budget-s 150 --out "$OUT" 2>&1 | tee "$OUT/log3.txt"
