"""The results tables of README.md and docs/, generated from benchmarks/results/*.json: one source for every figure.

    python benchmarks/render_results.py           # rewrite the generated tables in every page of PAGES
    python benchmarks/render_results.py --check   # exit 1 when a page and its JSON disagree (a test runs this)

A generated table sits between `<!-- generated: NAME -->` and `<!-- end generated -->`; everything else on
the page is written by hand. Each table names the machine it was measured on (in a row, a column or its first
header cell), as its results file records it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", ROOT / "docs" / "performance.md", ROOT / "docs" / "evaluation.md",
         ROOT / "docs" / "engine.md"]

# What each results file measured, in a user's words (the figures come from the file).
LEARNING_ROWS = [
    ("seed_spread", '`"37+45="` → `"82"` exact match; tiny Llama (658k params) + SFT warm start (the default, '
                    '`make run`)'),
    ("smollm2_seeds", '"What is 17 + 25?" last-number match; SmolLM2-135M-Instruct + LoRA (`make run-smollm2`)'),
    ("smollm2_reasoning_seeds", "two-step word problems reasoned in up to 128 tokens, last-number match; "
                                "SmolLM2-135M-Instruct, SFT on worked solutions, then GRPO + LoRA at temperature "
                                "1.0 (`make run-smollm2-reasoning`)"),
    ("smollm2_calculator_seeds", '"What is 347 * 82?" with a calculator tool, last-number match of the final answer; '
                                 "SmolLM2-135M-Instruct, SFT on a few worked tool conversations, then GRPO + LoRA "
                                 "over whole episodes (`make run-smollm2-calculator`)"),
    ("smollm2_calculator_no_tools_seeds", "the same prompts, model and budget without the tool (SFT on the answers "
                                          "alone): what one turn can do"),
    ("gemma3_270m", '`"21+9=30\\n17+25="` first-number match after three worked sums; Gemma 3 270M, a base model '
                    "(262k-token vocabulary) + LoRA (`make run-gemma3`)"),
    ("gemma3_270m:SmolLM2-135M-Instruct", "the same prompts, budget and settings with SmolLM2-135M-Instruct, seeds "
                                          "alternating with Gemma's"),
]
SPEED_ROWS = {
    "smollm2-lora": "SmolLM2-135M-Instruct, LoRA rank 16",
    "smollm2-full": "SmolLM2-135M-Instruct, full fine-tuning",
    "tiny": "tiny default",
    "smollm2-long": "SmolLM2-135M-Instruct, LoRA, word problems in up to 128 tokens at temperature 1.0",
    "calculator": "SmolLM2-135M-Instruct, LoRA, a calculator tool: episodes of up to 3 turns in 96 tokens, against "
                  "TRL's tool loop",
}

# docs/performance.md's side-by-side columns and phase columns, in the page's order.
SIDE_BY_SIDE_COLUMNS = {"tiny": "tiny", "smollm2-lora": "SmolLM2-135M LoRA", "smollm2-full": "SmolLM2-135M full"}
PROFILE_COLUMNS = {"smollm2-lora": "SmolLM2 LoRA", "smollm2-full": "SmolLM2 full", "tiny": "tiny"}
MATMUL_OPS = ("aten::mm", "mkldnn::_linear_pointwise")
# benchmarks/heldout_curves.py's cases, in docs/evaluation.md's words.
HELDOUT_CASES = {
    "default": "the default",
    "random_labels": "random labels (a 6-character prompt, an answer drawn from 0-3)",
    "smollm2_addition": "SmolLM2 addition",
    "smollm2_reasoning": "SmolLM2 reasoning",
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
    return (text.replace("AVX512", "AVX-512").replace("Intel(R) Xeon(R) Processor @ 2.50GHz", "Intel Xeon 2.50GHz")
            .replace("Intel(R) Xeon(R) Processor", "Intel Xeon"))


def _machine(machine: Any) -> str:
    """The CPU alone: `_cpu` without the Python or torch version and thread count some files add."""
    return re.sub(r", (\d+ threads|Python [^,]*|torch [^,]*)", "", _cpu(machine))


def _signed(x: float) -> str:
    """A signed figure with three decimals and a typographic minus, as the docs write them."""
    return f"{x:+.3f}".replace("-", "\u2212")


def _rate(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _seconds(x: float) -> str:
    """Three significant digits (three decimals below one second)."""
    return f"{x:.3f}" if x < 1 else f"{x:.{max(0, 2 - int(math.floor(math.log10(x))))}f}"


def _memory(ours_mb: float, trl_mb: float) -> str:
    """Two peak resident sets recorded in MiB, in MiB while both are under `1 GiB`, else in GiB."""
    if max(ours_mb, trl_mb) < 1024:
        return f"{ours_mb:.0f} / {trl_mb:.0f} MiB"
    return f"{ours_mb / 1024:.1f} / {trl_mb / 1024:.1f} GiB"


def learning_table() -> str:
    lines = ["| task, model | runs, machine | before GRPO | after GRPO | paired improvement | lowest 95% CI low | "
             "one run |", "|---|---|---|---|---|---|---|"]
    for entry, what in LEARNING_ROWS:
        name, _, model = entry.partition(":")  # "file:model": a model measured beside the file's own
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
            s = d["beside"][model] if model else d["summary"]
            seeds = len({r["seed"] for r in d["rows"]})
            runs = f"{seeds} seed{'s' if seeds != 1 else ''}, {_cpu(d['machine'])}"
            wall = s["wall_s"]  # "median (min .. max)" in seconds, or what a result file says instead
            cells = [s["before"], s["after"], s["improvement"], f"{s['lowest_ci95_low']:+.3f}",
                     f"{wall} s, whole run" if wall[:1].isdigit() else wall]
            if "grpo_tokens_per_s" in s and "beside" in d:  # two models side by side: their speed and memory too
                cells[-1] += f"; GRPO {s['grpo_tokens_per_s']} tokens/s, peak {s['peak_rss_mb']} MB"
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
        speed = f"**{row['speedup_vs_trl']:.2f}×** ({min(ratios):.2f} .. {max(ratios):.2f})"
        if "tools" in row:  # episodes: the model's own tokens a second say more than episodes of any length
            tokens = row["per_round_model_token_ratios"]
            speed = (f"model tokens/s **{row['model_tokens_per_s_ratio']:.2f}×** ({min(tokens):.2f} .. "
                     f"{max(tokens):.2f}), episodes/s {row['speedup_vs_trl']:.2f}× ({min(ratios):.2f} .. "
                     f"{max(ratios):.2f})")
        lines.append(f"| {SPEED_ROWS[row['row']]} | {speed}: {step} | {held['mean']:+.3f} ({held['ci95_low']:+.3f} .. "
                     f"{held['ci95_high']:+.3f}) | {memory} | {_cpu(row.get('machine', d['machine']))} |")
    return "\n".join(lines)


def side_by_side_table() -> str:
    """docs/performance.md: the short rows against TRL, one column per row."""
    d = _load("grpo_vs_trl")
    rows = {r["row"]: r for r in d["rows"]}
    cols = [rows[name] for name in SIDE_BY_SIDE_COLUMNS if name in rows]
    heads = [SIDE_BY_SIDE_COLUMNS[r["row"]] + (f" ({r['parameters'] / 1e6:.2f}M)" if r["row"] == "tiny" else "")
             for r in cols]

    def time_to_trl(r: dict[str, Any]) -> str:
        t = r["time_to_trl_final_heldout"]
        if not t["reported"]:
            return "not reported"
        return (f"{t['ours_train_seconds']:.1f} s, **{t['fraction']:.1%}** of TRL's "
                f"{t['trl_train_seconds']:.1f} s")

    def ratios(r: dict[str, Any]) -> str:
        x = r["per_round_ratios"]
        return f"{min(x):.2f} .. {max(x):.2f} ({len(x)} rounds)"

    def cells(r: dict[str, Any]) -> list[str]:
        ours, trl, held = r["engines"]["ours"], r["engines"]["trl"], r["heldout_ours_minus_trl"]
        return [
            f"**{r['speedup_vs_trl']:.2f}×**", ratios(r),
            f"{_rate(ours['completions_per_s'])} / {_rate(trl['completions_per_s'])}",
            f"{ours['generated_tokens_per_s']:.0f} / {trl['generated_tokens_per_s']:.0f} "
            f"({r['tokens_per_s_ratio']:.2f}×)",
            f"{_seconds(ours['step_seconds_median'])} / {_seconds(trl['step_seconds_median'])}",
            _memory(ours["peak_rss_mb"], trl["peak_rss_mb"]),
            f"{r['steps']} ({r['completions_each']:,})",
            f"{r['heldout_warm_start']:.3f}; {ours['heldout_reward']:.3f} / {trl['heldout_reward']:.3f} "
            f"(n = {r['heldout_n']})",
            f"{_signed(held['mean'])} ({_signed(held['ci95_low'])} .. {_signed(held['ci95_high'])})",
            time_to_trl(r), _machine(r.get("machine", d["machine"])),
        ]

    labels = ["**speedup_vs_trl** (median of per-round completions/s ratios)", "per-round ratios",
              "completions/s, ours / TRL", "generated tokens/s, ours / TRL (ratio)", "s/step median, ours / TRL",
              "peak RSS, ours / TRL", "steps each (completions)",
              "held-out: shared start; ours / TRL after equal completions",
              "ours − TRL (paired 95% CI over prompts)", "time to TRL's final held-out reward", "machine"]
    columns = [cells(r) for r in cols]
    lines = ["| | " + " | ".join(heads) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(c[i] for c in columns) + " |" for i, label in enumerate(labels)]
    return "\n".join(lines)


def long_row_table() -> str:
    """docs/performance.md: the `smollm2-long` row against TRL, ours and TRL side by side."""
    d = _load("grpo_vs_trl")
    r = next(r for r in d["rows"] if r["row"] == "smollm2-long")
    ours, trl, held = r["engines"]["ours"], r["engines"]["trl"], r["heldout_ours_minus_trl"]
    x = r["per_round_ratios"]
    both = {
        f"completions/s (median of {len(x)} measured rounds)":
            (_rate(ours["completions_per_s"]), _rate(trl["completions_per_s"])),
        "speedup": (f"**{r['speedup_vs_trl']:.2f}×** (rounds {min(x):.2f} .. {max(x):.2f})", ""),
        "s/step median": (_seconds(ours["step_seconds_median"]), _seconds(trl["step_seconds_median"])),
        "peak RSS": tuple(f"{e['peak_rss_mb'] / 1024:.1f} GiB" for e in (ours, trl)),
        "distinct completions; completion tokens (mean)":
            tuple(f"{e['distinct_completion_frac']:.0%}; {e['completion_tokens_mean']:.1f}" for e in (ours, trl)),
        f"held-out after {r['completions_each']} completions (n = {r['heldout_n']}, "
        f"start {r['heldout_warm_start']:.3f})":
            (f"{ours['heldout_reward']:.3f}", f"{trl['heldout_reward']:.3f} (ours − TRL {_signed(held['mean'])}, "
                                              f"CI {_signed(held['ci95_low'])} .. {_signed(held['ci95_high'])})"),
        "time share: generation / policy":
            tuple(f"{e['time_share']['generation']:.0%} / {e['time_share']['policy']:.0%}" for e in (ours, trl)),
    }
    lines = [f"| {_machine(r.get('machine', d['machine']))} | ours | TRL |", "|---|---|---|"]
    lines += [f"| {label} | {a} | {b} |" for label, (a, b) in both.items()]
    return "\n".join(lines)


def gpu_long_row_table() -> str:
    """docs/performance.md: the long row in bfloat16 on a GPU (benchmarks/gpu_long_row.py), before and after."""
    d = _load("gpu_long_row")
    lines = [f"| {d['machine']}: run | variant | completion tokens/s (step) | generation tokens/s | completions/s | "
             "peak GPU memory, allocated / reserved | held-out reward, start → after |",
             "|---|---|---:|---:|---:|---:|---|"]
    for run in d["runs"]:
        for r in run["variants"]:
            if "error" in r:
                continue
            lines.append(f"| {run['label']} | {r['variant']} | {r['completion_tokens_per_s']:.0f} | "
                         f"{r['generation_tokens_per_s']:.0f} | {r['completions_per_s']:.1f} | "
                         f"{r['peak_gpu_allocated_gb']:.2f} / {r['peak_gpu_reserved_gb']:.2f} GiB | "
                         f"{run['heldout_start']:.3f} → {r['heldout_after']:.3f} after {r['steps']} steps |")
    return "\n".join(lines)


def step_memory_detail_table() -> str:
    """docs/performance.md: peak memory, its estimate and the phases' seconds of one SmolLM2 step by length."""
    d = _load("long_completions")
    after = {(r["mode"], r["length"]): r for r in d["results"] if r["engine"] == "after"}
    lengths = sorted({length for _, length in after})

    def row(n: int) -> str:
        present = [after[(m, n)] for m in ("lora", "full") if (m, n) in after]
        all_off = all(not r.get("checkpointing", True) for r in present)
        cells = []
        for mode in ("lora", "full"):
            r = after.get((mode, n))
            if r is None:
                cells += ["-", "-"]
                continue
            off = "" if all_off or r.get("checkpointing", True) else ", checkpointing off"
            cells += [f"{r['peak_rss_gb']:.2f} GB ({r['estimate_gb']:.1f}){off}",
                      f"{r['generation_s']:.1f} / {r['update_s']:.1f} s"]
        return f"| {n}{' (checkpointing off)' if all_off else ''} | " + " | ".join(cells) + " |"

    lines = [f"| completion tokens ({_machine(d['machine'])}) | LoRA: peak RSS (estimate) | LoRA: generation / update "
             "| full: peak RSS (estimate) | full: generation / update |", "|---:|---:|---:|---:|---:|"]
    return "\n".join(lines + [row(n) for n in lengths])


def profile_table() -> str:
    """docs/performance.md: a step's phases, median of the measured steps (`after`: the current engine)."""
    d = _load("profile_step")
    runs = [d[name]["after"] for name in PROFILE_COLUMNS if name in d]
    heads = [name for name in PROFILE_COLUMNS if name in d]

    def phase(r: dict[str, Any], seconds: float, share: bool = True) -> str:
        step = r["step_seconds"]
        if seconds == 0:
            return "0"
        text = f"{seconds * 1000:.1f} ms" if step < 1 else f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds:.3f} s"
        return text + (f" ({seconds / step:.0%})" if share else "")

    def top_other(r: dict[str, Any]) -> str:
        op = next(o for o in r["top_ops"] if o["op"] not in MATMUL_OPS)
        return f"`{op['op'].split('::')[-1]}` {phase(r, op['self_cpu_s_per_step'], share=False)}"

    def other(r: dict[str, Any]) -> float:
        p = r["phases_seconds"]
        return p["reward"] + p["other (entropy, logging, Python)"]

    rows = [("**whole step**", lambda r: f"**{phase(r, r['step_seconds'], share=False)}**")]
    rows += [(name, lambda r, name=name: phase(r, r["phases_seconds"][name]))
             for name in ("generation", "reference", "policy forward", "policy backward")]
    rows += [("optimizer; reward, entropy, logging, Python",
              lambda r: f"{phase(r, r['phases_seconds']['optimizer'], False)}; {phase(r, other(r), False)}"),
             ("matrix products (`aten::mm` + oneDNN's `mkldnn::_linear_pointwise`), share of CPU time",
              lambda r: f"{sum(o['share'] for o in r['top_ops'] if o['op'] in MATMUL_OPS):.0%}"),
             ("top non-matmul operator", top_other),
             ("measured steps", lambda r: str(r["measured_steps"])),
             ("machine", lambda r: _machine(r["machine"]))]
    lines = ["| phase (median of the measured steps) | " + " | ".join(PROFILE_COLUMNS[h] for h in heads) + " |",
             "|---" * (len(heads) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cell(r) for r in runs) + " |" for label, cell in rows]
    return "\n".join(lines)


def heldout_table() -> str:
    """docs/evaluation.md: training rise against held-out change, every run of benchmarks/heldout_curves.py."""
    d = _load("heldout_curves")
    lines = [f"| run (case, seed), {_machine(d['machine'])} | training rise | held-out change over the start (noise) "
             "| heldout_flat | evaluate improvement (95% CI) |", "|---|---|---|---|---|"]
    for r in sorted(d["rows"], key=lambda r: (r["case"], r["seed"])):
        flat = ("0" if r["heldout_flat"] == 0 else f"{r['heldout_flat']:.3f}") + (", warned" if r["breached"] else "")
        lines.append(f"| {HELDOUT_CASES.get(r['case'], r['case'])}, seed {r['seed']} | {_signed(r['train_gain'])} | "
                     f"{_signed(r['heldout_gain'])} (±{r['heldout_noise']:.3f}) | {flat} | "
                     f"{_signed(r['improvement'])} ({_signed(r['ci95_low'])} .. {_signed(r['ci95_high'])}) |")
    return "\n".join(lines)


def variants_table(task: str) -> str:
    """docs/engine.md: benchmarks/grpo_variants.py's runs of a task, one row per variant, spread over the seeds."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.grpo_variants import VARIANTS, summary

    d = _load(f"grpo_variants_{task}")
    lines = [f"| variant ({d['meta']['completions']:,} completions a run; {_machine(d['meta']['machine'])}) | seeds "
             "| held-out after | improvement over the warm start | lowest 95% CI low | on-policy gap, "
             "mean / largest token |", "|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        r = summary(d["rows"], variant)
        if r:
            lines.append(f"| {variant} | {r['n']} | {r['final']:.3f} | {_signed(r['gain'])} ({_signed(r['low'])} .. "
                         f"{_signed(r['high'])}) | {_signed(r['ci_low_min'])} | "
                         f"{r['gap_mean']:.1e} / {r['gap_max']:.1e} |")
    return "\n".join(lines)


def gpu_rows_table() -> str:
    """docs/performance.md: benchmarks/gpu_rows.py's last run (the long row against TRL, the scale rows)."""
    path = RESULTS / "gpu_rows.json"
    if not path.exists():
        return ("Not measured yet: no GPU was at hand since benchmarks/gpu_rows.py was written (the command is in "
                "the section above).")
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_rows_report import markdown

    return markdown(json.loads(path.read_text())).split("\n", 4)[4].rstrip()
def quick_start_output() -> str:
    """README: the lines the default's `make run` ended with (benchmarks/quick_start.py), as a code block."""
    return "\n".join(["```", *_load("quick_start")["run"]["result_lines"], "```"])


def load_text(load: dict[str, float]) -> str:
    """'load 3.1, highest 4.0' from benchmarks/quick_start.py's samples, or the readings an older run recorded."""
    if "mean" in load:
        return f"load {load['mean']}, highest {load['max']}"
    return ", ".join(f"load {value} at the {when}" for when, value in load.items())


def quick_start_figures() -> str:
    """README: the install's and the first run's time, size and memory, with what they were measured with."""
    d = _load("quick_start")
    i, r = d["install"], d["run"]
    cache = "already held the wheels" if i["pip_cache_gb_before"] >= 1 else "was empty"
    urls = [s for s in i["package_sources"] if s.startswith(("https://", "http://"))]
    sources = ", ".join(urls) if len(urls) == len(i["package_sources"]) else \
        "the measuring machine's own package mirrors, not the default sources"  # never a path of that machine
    return (f"Measured by `{d['command']}` ([quick_start.md](benchmarks/results/quick_start.md)) "
            f"on {_cpu(d['machine'])}, {d['python']}, packages from {sources} (pip's cache "
            f"{cache}): the install took {i['seconds']} s ({load_text(i['load_average_1min'])}) and {i['venv_gb']} GB "
            f"in `.venv/` ({i['torch'].split(':')[0]}); the first run {r['seconds']} s "
            f"({load_text(r['load_average_1min'])}), peak resident memory of all its processes together "
            f"{r['peak_tree_gib']:.1f} GiB. A load above the {d['machine']['cores']} cores means other jobs shared "
            "them: the seconds are then longer than alone.")


TABLES: dict[str, Callable[[], str]] = {
    "learning": learning_table, "speed-vs-trl": speed_table,
    "trl-side-by-side": side_by_side_table, "trl-long-row": long_row_table, "gpu-long-row": gpu_long_row_table,
    "step-memory-detail": step_memory_detail_table, "step-phases": profile_table, "heldout-flat": heldout_table,
    "variants-default": lambda: variants_table("default"), "variants-smollm2": lambda: variants_table("smollm2"),
    "gpu-rows": gpu_rows_table,
    "quick-start-output": quick_start_output, "quick-start": quick_start_figures,
}


def render(page: str) -> str:
    """The page with every generated table replaced by what its JSON says now."""
    def table(match: re.Match) -> str:
        return f"{match.group(1)}\n{TABLES[match.group(2)]()}\n{match.group(3)}"

    # An empty block (the markers on consecutive lines) is filled too, never merged with the next block.
    return re.sub(r"(<!-- generated: ([\w-]+) -->)\n(?:.*?\n)??(<!-- end generated -->)", table, page, flags=re.S)


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
