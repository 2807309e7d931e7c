#!/usr/bin/env bash
# The pipeline on the GPU, second of two calls (docs/performance.md, "The pipeline on a GPU"): needs
# .whl-pipeline/b, timeout_s 540, and, from earlier calls on the same warm machine, the first part of the wheels
# (pipeline_call1.sh) and the SmolLM2 GGUF assembled by the rows' second call (call2.sh). Installs both parts, then
# runs `grpo-pipeline run` on the GPU example through Prefect and DVC as on the CPU, and copies its records to $OUT.
set -o pipefail
test -f .device-keep/wheels/.part-a || { echo "the first part is not kept: run pipeline_call1.sh first, warm"; exit 3; }
g=.device-keep/SmolLM2-135M-Instruct.Q4_1.gguf
test -f "$g" || { echo "no GGUF in .device-keep: run the rows' call1.sh and call2.sh first, warm"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .device-keep/site \
  .device-keep/wheels/*.whl .whl-pipeline/b/*.whl || exit 9
# What the pipeline's commands call by name (dvc.yaml's `python -m ...`, the CLI), on this image's python3.
mkdir -p .device-keep/bin && ln -sf "$(command -v python3)" .device-keep/bin/python
printf '#!/bin/sh\nexec python3 -m pipelines.cli "$@"\n' > .device-keep/bin/grpo-pipeline
printf '#!/bin/sh\nexec python3 -m dvc "$@"\n' > .device-keep/bin/dvc
chmod +x .device-keep/bin/grpo-pipeline .device-keep/bin/dvc
export PATH="$PWD/.device-keep/bin:$PATH" PYTHONPATH="$PWD/.device-keep/site:$PWD"
# DVC records runs in git: a repository of this copy, as a clone would be.
test -d .git || { git init -q && git add -A && git -c user.email=gpu@local -c user.name=gpu commit -qm copy; } || exit 9
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/card.txt"
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_memory_mib.txt" &
sampler=$!
start=$(date +%s)
PYTHONUNBUFFERED=1 grpo-pipeline run --params configs/examples/smollm2_reasoning_gpu.yaml \
  --set "model.name_or_path=$g" 2>&1 | tee "$OUT/pipeline.txt"
status=${PIPESTATUS[0]}
echo "{\"exit_status\": $status, \"wall_s\": $(( $(date +%s) - start ))}" > "$OUT/pipeline_status.json"
kill "$sampler" 2>/dev/null
# The registered model answering one request, loaded as `mlflow models serve` loads it.
python3 - > "$OUT/served.json" <<'PY'
import json
from pathlib import Path

import mlflow
import pandas
from mlflow import MlflowClient

from components.tracking.runs import tracking_uri

mlflow.set_tracking_uri(tracking_uri(Path(".")))
name = "grpo-smollm2-reasoning-gpu"
latest = max(MlflowClient().search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))
uri = f"models:/{name}/{latest.version}"
prompt = "Ana has 7 apples. Ana buys 5 more and then gives 3 away. How many apples does Ana have now?"
print(json.dumps({"model": uri, "prompt": prompt,
                  "answer": list(mlflow.pyfunc.load_model(uri).predict(pandas.DataFrame({"prompt": [prompt]})))},
                 default=str))
PY
mkdir -p "$OUT/plots" && cp plots/grpo_steps.csv "$OUT/plots/" 2>/dev/null
cp -r metrics logs params.yaml dvc.lock "$OUT/" 2>/dev/null
python3 -m pip list --format=json > "$OUT/packages.json" 2>/dev/null
exit "$status"
