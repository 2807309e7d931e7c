#!/usr/bin/env bash
# The pipeline on the GPU, first of two calls (docs/performance.md, "The pipeline on a GPU"): needs .whl-pipeline/a
# (`make gpu-pipeline-carry`), timeout_s 120. Records the image's own packages, then installs the first part of the
# pipeline's wheels into the working tree's copy (.device-keep/site, git-ignored), where the second call finds it
# while the machine stays warm.
set -o pipefail
python3 -m pip list --format=json > "$OUT/image_packages.json" 2>/dev/null || true
test -d .whl-pipeline/a || { echo ".whl-pipeline/a missing: make gpu-pipeline-carry, and carry it"; exit 9; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .device-keep/site \
  .whl-pipeline/a/*.whl || exit 9
touch .device-keep/site/.part-a && ls .whl-pipeline/a | tee "$OUT/part-a.txt" | wc -l
