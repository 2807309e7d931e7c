"""benchmarks/gpu_rows.py's report: the targets of issue 55 checked against a run, and its tables (the script writes
benchmarks/results/gpu_rows.md; render_results.py puts the same table in docs/performance.md)."""

from __future__ import annotations

from typing import Any

LONG_STEP_TOKENS_S = 10_000  # the long row's whole step, completion tokens/s
LONG_VS_TRL = 3.0  # times TRL's completion tokens/s on the same card
GENERATION_TOKENS_S = 20_000  # 135M at 64 rows, generation alone
FULL_1_5B_GB = 80.0  # the 1.5B shape's full fine-tuning at 64 x 512 fits one 80 GB card


def _rows(report: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [r for r in report.get("rows", []) if r.get("row") == kind and "error" not in r]


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target against the run: the figure, the target and whether it is met (None: not measured)."""
    out = []
    for r in _rows(report, "long"):
        ours, label = r["engines"]["ours"], f"long row, {r['mode']}, {r['length']} tokens"
        out += [{"what": f"{label}: completion tokens/s of a step", "value": ours["completion_tokens_per_s"],
                 "target": f">= {LONG_STEP_TOKENS_S:,}", "met": ours["completion_tokens_per_s"] >= LONG_STEP_TOKENS_S},
                {"what": f"{label}: times TRL", "value": r["speedup_vs_trl"], "target": f">= {LONG_VS_TRL}",
                 "met": r["speedup_vs_trl"] >= LONG_VS_TRL},
                {"what": f"{label}: generation tokens/s", "value": ours["generation_tokens_per_s"],
                 "target": f">= {GENERATION_TOKENS_S:,}",
                 "met": ours["generation_tokens_per_s"] >= GENERATION_TOKENS_S}]
    full = [r for r in report.get("rows", []) if r.get("row") == "scale" and r.get("shape") == "qwen2.5-1.5b"
            and r.get("mode") == "full"]
    if full:
        r = full[0]
        peak = None if "error" in r else r["ours"]["peak_gpu_gb"]
        out.append({"what": "1.5B full fine-tuning at 64 x 512: peak GPU memory (GB)", "value": peak if peak else
                    r.get("error", "?"), "target": f"<= {FULL_1_5B_GB:.0f}",
                    "met": peak is not None and peak <= FULL_1_5B_GB})
    return out


def _f(x: Any, digits: int = 0) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}" if isinstance(x, (int, float)) else str(x)


def _peak(e: dict[str, Any], row: dict[str, Any]) -> str:
    host = row.get("process_peak_rss_gb")
    return _f(e.get("peak_gpu_gb"), 1) + (f" ({host:.1f})" if host is not None else "")


def _ours(e: dict[str, Any]) -> str:
    """Ours, with the engine that ran (and its decoding mode: `token_loop` means a capture failed)."""
    mode = f", {e['mode']}" if e.get("mode") else ""
    return f"ours ({e['engine']}{mode})" if e.get("engine") else "ours"


def table(report: dict[str, Any]) -> str:
    """The rows of a run as one table: the card and versions first, then each row with its distance from the card."""
    c, ceiling = report["card"], report.get("ceiling", {})
    lines = [f"{c['device']}; torch {c['torch']}, CUDA {c['cuda']}, transformers {c['transformers']}, TRL "
             f"{c.get('trl')}; measured ceilings {ceiling.get('bandwidth_gbs')} GB/s copy, "
             f"{ceiling.get('bf16_tflops')} TFLOP/s bf16 matmul. vLLM cannot be installed on these machines: TRL "
             "generates with Hugging Face `generate`.", "",
             "| row | engine | completion tokens/s (step) | generation tokens/s | reference / update tokens/s | "
             "peak GPU GB (host RSS so far) | generation vs bandwidth floor | update MFU |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in report.get("rows", []):
        if "error" in r:
            lines.append(f"| {r.get('row')} {r.get('shape', '')} {r.get('mode', '')} | failed: {r['error'][:120]} "
                         "||||||")
            continue
        if r["row"] == "long":
            name = f"long: {r['shape']} {r['mode']}, 64 x {r['length']}"
            for engine in ("ours", "trl"):
                e = r["engines"][engine]
                extra = (f"{r['generation_share_of_bandwidth']:.0%} ({r['decode_step_mb']:.0f} MB a step)",
                         f"{r['update_mfu']:.1%}") if engine == "ours" else ("", "")
                speed = f" (**{r['speedup_vs_trl']:.2f}x**)" if engine == "ours" else ""
                lines.append(f"| {name} | {_ours(e) if engine == 'ours' else 'TRL ' + r['trl_version']} | "
                             f"{_f(e['completion_tokens_per_s'])}{speed} | {_f(e['generation_tokens_per_s'])} | "
                             f"- / {_f(e['tokens'] / e['update_s'])} | {_peak(e, r)} | {extra[0]} | "
                             f"{extra[1]} |")
        elif r["row"] == "scale":
            o = r["ours"]
            lines.append(f"| scale: {r['shape']} ({r['parameters'] / 1e9:.2f}B) {r['mode']}, 64 x {r['length']}"
                         f"{', checkpointing' if o.get('gradient_checkpointing') else ''} | {_ours(o)} | "
                         f"{_f(o['completion_tokens_per_s'])} | {_f(o['generation_tokens_per_s'])} | "
                         f"{_f(o.get('reference_tokens_per_s'))} / {_f(o.get('update_tokens_per_s'))} | "
                         f"{_peak(o, r)} | {r['generation_share_of_bandwidth']:.0%} "
                         f"({r['decode_step_mb']:.0f} MB a step) | "
                         f"{r['update_mfu']:.1%} |")
        elif r["row"] == "compile_step":
            lines.append(f"| option: compile_step, {r['shape']} generation, 64 x {r['length']} | ours | | "
                         f"{_f(r['graphs']['generation_tokens_per_s'])} graphs; "
                         f"{_f(r['compiled']['generation_tokens_per_s'])} compiled (first step "
                         f"{r['compiled']['first_step_s']} s) | | | | |")
        elif r["row"] == "heldout":
            trl = "" if r.get("trl") is None else (f", TRL {r['trl']:.3f} "
                                                   f"(ours - TRL {r['ours_minus_trl']['mean']:+.3f}"
                                                   f", CI {r['ours_minus_trl']['ci95_low']:+.3f} .. "
                                                   f"{r['ours_minus_trl']['ci95_high']:+.3f})")
            lines.append(f"| held-out, {r['mode']}, after {r['completions']:,} completions (n = {r['n']}, start "
                         f"{r['start']:.3f}) | ours {r['ours']:.3f}{trl} | | | | {_f(r.get('ours_peak_gpu_gb'), 1)} "
                         "| | |")
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    commands = report.get("commands") or [report["command"]]
    lines = ["# GPU rows (benchmarks/gpu_rows.py)", "", "; ".join(f"`{c}`" for c in commands), "", table(report), ""]
    if report.get("targets"):
        lines += ["| target (issue 55) | measured | target | met |", "|---|---:|---|---|"]
        lines += [f"| {t['what']} | {_f(t['value'], 2 if isinstance(t['value'], float) and t['value'] < 100 else 0)} "
                  f"| {t['target']} | {'yes' if t['met'] else 'no'} |" for t in report["targets"]]
        lines.append("")
    if report.get("gpu_tests"):
        lines += [f"GPU tests (`pytest -m gpu`): {report['gpu_tests']['summary']}", ""]
    if report.get("skipped"):
        lines += ["Skipped: " + "; ".join(report["skipped"]), ""]
    return "\n".join(lines)
