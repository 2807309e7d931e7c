"""What a pipeline run on the GPU machine must bring, and how it fits the transfers to it.

The GPU machine's image has the ML stack (torch, transformers, numpy, pandas, ...) but not the pipeline's own
frameworks: Prefect, MLflow, DVC and Great Expectations, with everything they need that the image lacks. This lists
that set from the locked environment's own metadata (each package pinned to the version installed here), and splits
downloaded wheels into parts that each fit one transfer to the machine (beside the working tree).

    python benchmarks/device/pipeline_wheels.py --list > .whl-pipeline/requirements.txt   # `make gpu-pipeline-carry`
    python benchmarks/device/pipeline_wheels.py --split .whl-pipeline/all --into .whl-pipeline --part-mib 56
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import shutil
import sys
from pathlib import Path

# What the pipeline needs beyond the ML stack (pyproject.toml's dependencies).
PIPELINE_ROOTS = ("grpo-pipeline",)
# What the GPU image has (its card in benchmarks/results/gpu_rows.json) and `make gpu-carry` brings (GPU_WHEELS):
# their closures are left out.
ML_IMAGE_ROOTS = ("torch", "transformers", "accelerate", "numpy", "pandas", "scipy", "pyarrow", "safetensors",
                  "tokenizers", "peft", "psutil", "pyyaml", "requests")
# Needed beyond the metadata's required dependencies: gguf (the model stage reads a .gguf through it, an extra) and
# antlr4 (DVC's hydra reads it; its 4.9.3 is source only, built here as a wheel).
EXTRA = ("gguf", "antlr4-python3-runtime")


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _installed() -> dict[str, metadata.Distribution]:
    return {_name(d.metadata["Name"]): d for d in metadata.distributions()}


def closure(roots: tuple[str, ...], installed: dict[str, metadata.Distribution]) -> set[str]:
    """The installed distributions `roots` need, at any depth (extras left out)."""
    seen: set[str] = set()
    todo = [_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name not in installed:
            continue
        seen.add(name)
        for requirement in installed[name].requires or []:
            if "extra ==" not in requirement:
                todo.append(_name(re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0]))
    return seen


def pipeline_requirements() -> list[str]:
    """`name==version` of every package a pipeline run needs that the GPU image and the rows' wheels lack."""
    installed = _installed()
    needed = (closure(PIPELINE_ROOTS, installed) | {_name(e) for e in EXTRA}) - closure(ML_IMAGE_ROOTS, installed)
    needed -= {_name(r) for r in PIPELINE_ROOTS}  # the project itself travels as the working tree
    return sorted(f"{installed[n].metadata['Name']}=={installed[n].version}" for n in needed if n in installed)


def split(source: Path, into: Path, part_mib: float, parts_at_most: int = 0) -> list[list[str]]:
    """Wheels of `source` into parts `into`/a, b, ... of at most `part_mib` MiB each, largest first into the part
    with the most room; returns each part's file names. A wheel larger than a part is an
    error: no transfer could carry it; so is needing more than `parts_at_most` parts (when given), the calls that
    install them."""
    limit = part_mib * 2**20
    wheels = sorted(source.glob("*.whl"), key=lambda p: (-p.stat().st_size, p.name))  # the same parts anywhere
    parts: list[list[Path]] = []
    for wheel in wheels:
        size = wheel.stat().st_size
        if size > limit:
            raise ValueError(f"{wheel.name} is {size / 2**20:.1f} MiB, more than a part ({part_mib} MiB)")
        room = [limit - sum(p.stat().st_size for p in part) for part in parts]
        fits = [i for i, left in enumerate(room) if left >= size]
        if fits:
            parts[max(fits, key=lambda i: room[i])].append(wheel)
        else:
            parts.append([wheel])
    if parts_at_most and len(parts) > parts_at_most:
        raise ValueError(f"the wheels need {len(parts)} parts of {part_mib} MiB; the device calls install "
                         f"{parts_at_most}")
    for letter, part in zip("abcdefghij", parts, strict=False):
        (into / letter).mkdir(parents=True, exist_ok=True)
        for wheel in part:
            shutil.copy2(wheel, into / letter / wheel.name)
    return [sorted(w.name for w in part) for part in parts]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the pinned requirements, one a line")
    parser.add_argument("--split", type=Path, help="a folder of downloaded wheels to split into parts")
    parser.add_argument("--into", type=Path, default=Path(".whl-pipeline"))
    parser.add_argument("--part-mib", type=float, default=56.0)
    parser.add_argument("--parts", type=int, default=0, help="fail when the wheels need more parts than this")
    args = parser.parse_args()
    if args.list:
        print("\n".join(pipeline_requirements()))
    if args.split:
        parts = split(args.split, args.into, args.part_mib, args.parts)
        for letter, names in zip("abcdefghij", parts, strict=False):
            size = sum((args.into / letter / n).stat().st_size for n in names) / 2**20
            print(f"{args.into / letter}: {len(names)} wheels, {size:.1f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
