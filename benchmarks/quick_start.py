"""The README's Quick start, measured as a stranger runs it: a fresh clone of the committed repository, `make setup`
(the install into a new .venv: seconds, size, which torch build, from where), then `make run` (seconds, peak
resident memory of its whole process tree, the lines it ends with). The README's install and run figures and
its output block are generated from the result (benchmarks/render_results.py).

    python benchmarks/quick_start.py [WORKDIR]   # writes benchmarks/results/quick_start.json and .md
    python benchmarks/quick_start.py --this-machines-sources   # a machine without PyPI: its own pip sources

pip runs as on a machine nobody configured: no pip configuration file and no PIP_* setting of this machine (its
mirrors, wheel folders or constraints), so packages come from PyPI and the CPU build of torch from the Makefile's
TORCH_CPU_INDEX; pip's cache is a new, empty folder. Run it alone on the machine: the figures hold for the
conditions it records beside them (the machine, the load average while it ran, where the packages came from).
The rewards are those of the default on this CPU kind (README "What reproduced means"). The results name no path
of this machine; a package source that is not a URL stops the script before it writes anything, unless
`--this-machines-sources` keeps this machine's pip sources (for a machine that cannot reach PyPI): each local one is
then recorded as "a local package source", never by its path, and the README says the packages came from the
measuring machine's own sources.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# The lines the README shows from the end of `grpo-pipeline run` on the default: from the first to the last.
FIRST_RESULT_LINE = "held-out mean reward before GRPO:"
LAST_RESULT_LINE = "registered model:"


# pip settings that are not package sources (how to reach them), kept from this machine's environment.
PIP_TRANSPORT = ("PIP_CERT", "PIP_CLIENT_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_PROXY", "PIP_RETRIES")
# pip's package sources, kept only with --this-machines-sources.
PIP_SOURCES = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX")
LOCAL_SOURCE = "a local package source"


def stranger_env(home: Path, keep_sources: bool = False) -> dict[str, str]:
    """This environment as a fresh shell on an unconfigured machine has it: no project venv on PATH, no tracking or
    Prefect server, a home of its own for Prefect, pip with its defaults (no configuration file, no PIP_* setting
    but how to reach the network, and with `keep_sources` where to find packages) and a new, empty cache."""
    venv_bin = str(ROOT / ".venv" / "bin")
    kept = PIP_TRANSPORT + (PIP_SOURCES if keep_sources else ())
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PYTHONPATH")
           and (not k.startswith("PIP_") or k in kept)}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env["PREFECT_HOME"] = str(home / "prefect")
    env["PIP_CONFIG_FILE"] = os.devnull  # pip loads no configuration file at all
    env["PIP_CACHE_DIR"] = str(home / "pip-cache")
    return env


def makefile_cpu_index() -> str:
    """The Makefile's default TORCH_CPU_INDEX: where `make` takes the CPU build of torch from."""
    text = (ROOT / "Makefile").read_text()
    return next(line.split("?=", 1)[1].strip() for line in text.splitlines() if line.startswith("TORCH_CPU_INDEX"))


def folder_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def pip_cache_bytes(env: dict[str, str]) -> int:
    proc = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], env=env, capture_output=True, text=True)
    folder = Path(proc.stdout.strip())
    return folder_bytes(folder) if proc.returncode == 0 and folder.is_dir() else 0


def package_sources(env: dict[str, str], cpu_torch: bool) -> list[str]:
    """Where pip takes packages from under `env`: its index (PyPI unless configured), extra indexes and wheel
    folders, and the Makefile's CPU index of torch when the CPU build was installed on Linux."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=env, capture_output=True, text=True)
    settings: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        settings.setdefault(key.rsplit(".", 1)[-1], []).extend(value.strip("'").split())
    for key in ("index-url", "extra-index-url", "find-links"):  # a PIP_* variable the environment kept
        settings.setdefault(key, []).extend(env.get("PIP_" + key.upper().replace("-", "_"), "").split())
    index = settings.get("index-url") or ["https://pypi.org/simple"]
    torch_index = [makefile_cpu_index()] if cpu_torch and platform.system() == "Linux" else []
    return sorted(set(index + settings.get("extra-index-url", []) + settings.get("find-links", []) + torch_index))


def local_sources(sources: list[str]) -> list[str]:
    """The package sources that are not URLs of a package index (a folder or file:// URL of this machine)."""
    return [s for s in sources if not s.startswith(("https://", "http://"))]


def recorded_sources(sources: list[str]) -> list[str]:
    """The sources as the results record them: URLs as they are, anything of this machine as `LOCAL_SOURCE`."""
    return sorted({LOCAL_SOURCE if s in local_sources(sources) else s for s in sources})


class TreePeak:
    """Peak of the summed resident memory of a process and all its descendants, sampled every 0.2 s, and the
    machine's 1-minute load average over the same time (mean and highest)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self.loads: list[float] = []
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            total = 0
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self.loads.append(os.getloadavg()[0])

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def timed(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> tuple[float, str, TreePeak]:
    """Run `cmd`: (seconds, output, its memory and load samples); a failure raises, naming the log."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples = TreePeak(proc.pid)
    out = proc.communicate()[0]
    seconds = time.perf_counter() - started
    samples.stop()
    log.write_text(out)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    return seconds, out, samples


def load(samples: TreePeak) -> dict[str, float]:
    loads = samples.loads or [0.0]
    return {"mean": round(sum(loads) / len(loads), 1), "max": round(max(loads), 1)}


def machine() -> dict[str, Any]:
    from components.tracking.run_environment import cpu_model

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "avx512": "avx512f" in flags,
            "system": f"{platform.system()} {platform.machine()}"}


def measure(work: Path, keep_sources: bool = False) -> dict[str, Any]:
    clone = work / "grpo-pipeline"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = stranger_env(work, keep_sources)
    sources = package_sources(env, cpu_torch=True)
    if local_sources(sources) and not keep_sources:
        raise RuntimeError(f"pip would take packages from this machine ({', '.join(local_sources(sources))}), not "
                           "the default sources; the README's figures need those")
    cache_before = pip_cache_bytes(env)
    install_s, install_out, install_samples = timed(["make", "setup"], clone, env, work / "make-setup.log")
    torch_line = next((line for line in install_out.splitlines() if line.startswith("torch ")), "")
    python = subprocess.run([str(clone / ".venv" / "bin" / "python"), "--version"], capture_output=True,
                            text=True).stdout.strip()
    run_s, run_out, run_samples = timed(["make", "run"], clone, env, work / "make-run.log")
    lines = run_out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(FIRST_RESULT_LINE))
    last = next(i for i, line in enumerate(lines) if i > first and line.startswith(LAST_RESULT_LINE))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True,
                            text=True).stdout.strip()
    return {
        "command": "python benchmarks/quick_start.py" + (" --this-machines-sources" if keep_sources else ""),
        "commit": commit, "machine": machine(),
        "finished": time.strftime("%Y-%m-%d"), "python": python,
        "install": {"command": "make setup (fresh clone, new .venv)", "seconds": round(install_s),
                    "venv_gb": round(folder_bytes(clone / ".venv") / 1e9, 1), "torch": torch_line,
                    "pip_cache_gb_before": round(cache_before / 1e9, 1),
                    "package_sources": recorded_sources(package_sources(env, cpu_torch="CPU build" in torch_line)),
                    "load_average_1min": load(install_samples)},
        "run": {"command": "make run (the default, right after the install)", "seconds": round(run_s),
                "peak_tree_gib": round(run_samples.peak / 2**30, 2), "load_average_1min": load(run_samples),
                "result_lines": lines[first:last + 1]},
    }


def markdown(r: dict[str, Any]) -> str:
    from render_results import load_text  # this folder is on the path when the script runs

    i, run, m = r["install"], r["run"], r["machine"]
    return "\n".join([
        "# The README's Quick start, measured", "",
        f"`{r['command']}` at {r['commit']} on {m['cpu']} ({m['cores']} cores{', AVX-512' if m['avx512'] else ''}), "
        f"{r['python']}, {r['finished']}. The machine's 1-minute load average is given beside each step: above "
        f"{m['cores']}, other jobs shared the cores and the seconds are longer than alone.", "",
        f"- `{i['command']}`: {i['seconds']} s ({load_text(i['load_average_1min'])}), {i['venv_gb']} GB in `.venv/`; "
        "packages from "
        f"{', '.join(i['package_sources'])}; pip's cache held {i['pip_cache_gb_before']} GB before; {i['torch']}",
        f"- `{run['command']}`: {run['seconds']} s ({load_text(run['load_average_1min'])}), peak resident memory of "
        f"its process tree {run['peak_tree_gib']} GiB",
        *(["", r["note"]] if r.get("note") else []),
        "", "Its last lines:", "", "```", *run["result_lines"], "```", ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir", nargs="?", help="scratch folder (default: a new temporary one)")
    parser.add_argument("--this-machines-sources", action="store_true",
                        help="keep this machine's pip sources (a machine without PyPI); recorded without their paths")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="grpo-quick-start-"))
    work.mkdir(parents=True, exist_ok=True)
    result = measure(work, args.this_machines_sources)
    (RESULTS / "quick_start.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "quick_start.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
