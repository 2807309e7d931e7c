"""The README's results tables, generated from benchmarks/results/*.json: one source for every figure.

    python benchmarks/render_results.py           # rewrite the generated tables in README.md
    python benchmarks/render_results.py --check   # exit 1 when a page and its JSON disagree (a test runs this)

A generated table sits between `<!-- generated: NAME -->` and `<!-- end generated -->`; everything else on
the page is written by hand. Each row names the machine it was measured on, as its results file records it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md"]

# What each results file measured, in a user's words (the figures come from the file).
LEARNING_ROWS = [
    ("seed_spread", '`"37+45="` → `"82"` exact match; tiny Llama (658k params) + SFT warm start (the default, '
                    '`make run`)'),
    ("smollm2_seeds", '"What is 17 + 25?" last-number match; SmolLM2-135M-Instruct + LoRA (`make run-smollm2`)'),
    ("smollm2_reasoning_seeds", "two-step word problems reasoned in up to 128 tokens, last-number match; "
                                "SmolLM2-135M-Instruct, SFT on worked solutions, then GRPO + LoRA at temperature "
                                "1.0 (`make run-smollm2-reasoning`)"),
]
SPEED_ROWS = {
    "smollm2-lora": "SmolLM2-135M-Instruct, LoRA rank 16",
    "smollm2-full": "SmolLM2-135M-Instruct, full fine-tuning",
    "tiny": "tiny default",
    "smollm2-long": "SmolLM2-135M-Instruct, LoRA, word problems in up to 128 tokens at temperature 1.0",
}


def _load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _spread(s: dict[str, float], sign: str = "") -> str:
    return f"{s['median']:{sign}.3f} ({s['min']:{sign}.3f} .. {s['max']:{sign}.3f})"


def _cpu(machine: Any) -> str:
    """The CPU as a results file names it ('x86_64' in files written before the model name was recorded)."""
    if isinstance(machine, dict):
        return f"{machine['cpu']} ({machine['cores']} cores{', AVX-512' if machine.get('avx512') else ''})"
    text = str(machine).split(", Python")[0].replace("x86_64,", "x86_64 (model not recorded),")
    return text.replace("AVX512", "AVX-512").replace("Intel(R) Xeon(R) Processor @ 2.50GHz", "Intel Xeon 2.50GHz")


def learning_table() -> str:
    lines = ["| task, model | runs, machine | before GRPO | after GRPO | paired improvement | lowest 95% CI low | "
             "one run |", "|---|---|---|---|---|---|---|"]
    for name, what in LEARNING_ROWS:
        d = _load(name)
        link = f"[{name}.md](benchmarks/results/{name}.md)"
        if name == "seed_spread":
            s = d["summary"]["all"]
            runs = f"{s['runs']}: {len(d['seeds'])} seeds × {len(d['kernels'])} kernel paths, {_cpu(d['machine'])}"
            cells = [_spread(s["warm_start"]), _spread(s["after_grpo"]), _spread(s["improvement"], "+"),
                     f"{s['ci95_low']['min']:+.3f}",
                     f"{s['seconds']['median']:.0f} s ({s['seconds']['min']:.0f} .. {s['seconds']['max']:.0f}), "
                     "stages' compute"]
        else:
            s = d["summary"]
            runs = f"{len(d['rows'])} seeds, {_cpu(d['machine'])}"
            cells = [s["before"], s["after"], s["improvement"], f"{s['lowest_ci95_low']:+.3f}",
                     f"{s['wall_s']} s, whole run"]
        lines.append(f"| {what} | {runs} ({link}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_table() -> str:
    d = _load("grpo_vs_trl")
    lines = ["| model | ours vs TRL, completions/s (per-round range) | held-out ours − TRL after equal completions "
             "(95% CI) | peak memory, ours / TRL | machine |", "|---|---|---|---|---|"]
    for row in sorted(d["rows"], key=lambda r: list(SPEED_ROWS).index(r["row"])):
        ours, trl, held = row["engines"]["ours"], row["engines"]["trl"], row["heldout_ours_minus_trl"]
        ratios = row["per_round_ratios"]
        step = (f"{ours['step_seconds_median'] * 1000:.0f} ms a step against "
                f"{trl['step_seconds_median'] * 1000:.0f} ms" if ours["step_seconds_median"] < 1 else
                f"{ours['step_seconds_median']:.1f} s a step against {trl['step_seconds_median']:.1f} s")
        memory = f"{ours['peak_rss_mb'] / 1024:.1f} / {trl['peak_rss_mb'] / 1024:.1f} GiB"
        lines.append(f"| {SPEED_ROWS[row['row']]} | **{row['speedup_vs_trl']:.2f}×** ({min(ratios):.2f} .. "
                     f"{max(ratios):.2f}): {step} | {held['mean']:+.3f} ({held['ci95_low']:+.3f} .. "
                     f"{held['ci95_high']:+.3f}) | {memory} | {_cpu(row.get('machine', d['machine']))} |")
    return "\n".join(lines)


def memory_table() -> str:
    """Peak resident memory of one SmolLM2 GRPO step by completion length (`after` rows: the current engine)."""
    d = _load("long_completions")
    after = {(r["mode"], r["length"]): r for r in d["results"] if r["engine"] == "after"}
    lengths = sorted({length for _, length in after})

    def cell(mode: str, length: int) -> str:
        r = after.get((mode, length))
        if r is None:
            return "-"
        return f"{r['peak_rss_gb']:.2f} GB" + ("" if r.get("checkpointing", True) else " (checkpointing off)")

    lines = [f"| completion tokens ({_cpu(d['machine'])}) | LoRA rank 16 | full fine-tuning |", "|---|---|---|"]
    lines += [f"| {n} | {cell('lora', n)} | {cell('full', n)} |" for n in lengths]
    return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {"learning": learning_table, "speed-vs-trl": speed_table,
                                        "step-memory": memory_table}


def render(page: str) -> str:
    """The page with every generated table replaced by what its JSON says now."""
    def table(match: re.Match) -> str:
        return f"{match.group(1)}\n{TABLES[match.group(2)]()}\n{match.group(3)}"

    return re.sub(r"(<!-- generated: ([\w-]+) -->)\n.*?\n(<!-- end generated -->)", table, page, flags=re.S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="report pages that disagree with their JSON")
    args = parser.parse_args()
    stale = []
    for page in PAGES:
        text = page.read_text()
        fresh = render(text)
        if fresh != text:
            stale.append(page)
            if not args.check:
                page.write_text(fresh)
    if args.check and stale:
        print("out of date with benchmarks/results: " + ", ".join(str(p.relative_to(ROOT)) for p in stale)
              + " (run python benchmarks/render_results.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
