#!/bin/sh
# Installs torch 2.13.0 into the project's venv as the build asked for, then says in one line which build it is.
#
#   install/torch.sh BUILD PYTHON CPU_INDEX WHY
#     BUILD      cpu | cuda
#     PYTHON     the venv's interpreter
#     CPU_INDEX  PyTorch's CPU wheel index (Linux: PyPI's own Linux wheels are the CUDA build, GBs of nvidia-* wheels)
#     WHY        why this build, for the line it prints ("no NVIDIA GPU found", "TORCH=cpu", ...)
#
# The CPU build comes from the configured package sources first (a mirror or a local wheel folder: `pip config list`),
# else from CPU_INDEX; macOS takes PyPI's wheel, which is the CPU build there. The CUDA build is PyPI's (CUDA 13.0).
# It fails, saying why, when the installed torch is not the build asked for.
set -eu
build=$1 py=$2 cpu_index=$3 why=$4
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }
install() { pip install --no-compile "$@"; }  # compiled later, in one pass (Makefile: PIP_INSTALL)

case "$build" in
cpu)
  if [ "$(uname -s)" = Darwin ]; then
    install torch==2.13.0
  elif ! install torch==2.13.0+cpu 2>/dev/null; then
    install torch==2.13.0+cpu --extra-index-url "$cpu_index" || {
      echo "make: the CPU build of torch 2.13.0 is in neither your package sources nor $cpu_index;" \
           "set TORCH_CPU_INDEX=URL (a mirror of it), or TORCH=cuda for PyPI's CUDA build (about 3 GB)" >&2
      exit 1; }
  fi ;;
cuda)
  # A CPU build installed before satisfies torch==2.13.0 (the local label is ignored): take it out first.
  if "$py" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' 2>/dev/null; then
    pip uninstall -y torch
  fi
  install torch==2.13.0 ;;
*)
  echo "make: TORCH=$build: use cpu, cuda or auto" >&2; exit 1 ;;
esac

"$py" - "$build" "$why" <<'PY'
import sys
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # numpy comes with the lock, next
import torch

build, why = sys.argv[1:]
cuda = torch.version.cuda
if cuda:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible to it"
    print(f"torch {torch.__version__}: the CUDA {cuda} build ({why}; {gpu}); `make TORCH=cpu ...` for the CPU build")
else:
    print(f"torch {torch.__version__}: the CPU build ({why}); `make TORCH=cuda ...` for the CUDA build")
if (build == "cuda") != bool(cuda):
    sys.exit(f"make: asked for the {build.upper()} build of torch, got {torch.__version__}: your pip configuration "
             "(`pip config list`: find-links, index-url) serves the other build first")
PY
