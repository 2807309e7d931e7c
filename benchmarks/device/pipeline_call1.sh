#!/usr/bin/env bash
# The pipeline on the GPU, first of two calls (docs/performance.md, "The pipeline on a GPU"): needs .whl-pipeline/a
# (`make gpu-pipeline-carry`), timeout_s 60. Records the image's own packages and keeps the first part of the
# pipeline's wheels in the working tree's copy (.device-keep/wheels, git-ignored), where the second call finds it
# while the machine stays warm and installs both parts in one go (two installs into one folder would each skip the
# folders the other made).
set -o pipefail
python3 -m pip list --format=json > "$OUT/image_packages.json" 2>/dev/null || true
test -d .whl-pipeline/a || { echo ".whl-pipeline/a missing: make gpu-pipeline-carry, and carry it"; exit 9; }
mkdir -p .device-keep/wheels && cp .whl-pipeline/a/*.whl .device-keep/wheels/ || exit 9
touch .device-keep/wheels/.part-a && ls .whl-pipeline/a | tee "$OUT/part-a.txt" | wc -l
