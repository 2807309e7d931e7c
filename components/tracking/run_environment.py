"""What decides whether two runs can be bit-identical: CPU kind, kernel path, threads, torch, lock file.

Recorded as registry tags (never in DVC outputs, whose hashes must not depend on where they were
made) and compared by `grpo-pipeline reproduce`: the same environment must give the same bits;
another CPU kind or thread count gives results within the measured band, not identical ones.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# Variables that move PyTorch, MKL and oneDNN onto other kernels (and so other rounding).
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_environment(threads: int, device: str) -> dict[str, str]:
    """`env.*` tags for this process (the pipeline's stages all run on one machine)."""
    import torch

    forced = ",".join(f"{k}={os.environ[k]}" for k in KERNEL_VARIABLES if os.environ.get(k))
    return {"env.cpu": cpu_model(), "env.cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "env.kernel_variables": forced or "none", "env.threads": str(threads or torch.get_num_threads()),
            "env.device": device, "env.torch": torch.__version__.split("+")[0]}


def differences(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """`key: recorded -> current` for each environment fact that differs (missing tags count as unknown)."""
    keys = sorted(k for k in current if k.startswith("env.") or k == "lineage.lock_md5")
    return [f"{k.removeprefix('env.')}: {recorded.get(k, 'unrecorded')} -> {current[k]}" for k in keys
            if recorded.get(k) != current[k]]
