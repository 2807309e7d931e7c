"""benchmarks/gpu_rows.py's report: the gate, the targets of issue 55 checked against a run, and its tables (the script
writes benchmarks/results/gpu_rows.md; render_results.py puts the same table in docs/performance.md)."""

from __future__ import annotations

from typing import Any

LONG_STEP_TOKENS_S = 10_000  # the long row's whole step, completion tokens/s
LONG_VS_TRL = 3.0  # times TRL's completion tokens/s on the same card
GENERATION_TOKENS_S = 20_000  # 135M at 64 rows, generation alone
FULL_1_5B_GB = 80.0  # the 1.5B shape's full fine-tuning at 64 x 512 fits one 80 GB card
TRL_ROWS = ("long", "wide", "real-wide", "real-eos")  # ours and TRL taking turns
OURS_ROWS = ("scale", "eos")  # ours alone


def _rows(report: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [r for r in report.get("rows", []) if r.get("row") == kind and "error" not in r]


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target against the run: the figure, the target and whether it is met."""
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
        peak = None if "error" in r else r["ours"].get("peak_allocated_gb", r["ours"].get("peak_gpu_gb"))
        out.append({"what": "1.5B full fine-tuning at 64 x 512: peak GPU memory allocated (GB)",
                    "value": peak if peak else r.get("error", "?"), "target": f"<= {FULL_1_5B_GB:.0f}",
                    "met": peak is not None and peak <= FULL_1_5B_GB})
    return out


def _f(x: Any, digits: int = 0) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}" if isinstance(x, (int, float)) else str(x)


def _memory(e: dict[str, Any], row: dict[str, Any]) -> str:
    allocated = e.get("peak_allocated_gb", e.get("peak_gpu_gb"))
    host = row.get("process_peak_rss_gb")
    return (f"{_f(allocated, 1)} / {_f(e.get('peak_reserved_gb'), 1)}"
            + (f" ({host:.1f})" if host is not None else ""))


def _ours(e: dict[str, Any]) -> str:
    """Ours, with the engine that ran (and its decoding mode: `token_loop` means a capture failed)."""
    mode = f", {e['mode']}" if e.get("mode") else ""
    return f"ours ({e['engine']}{mode})" if e.get("engine") else "ours"


def _gap(e: dict[str, Any]) -> str:
    return "-" if e.get("on_policy_gap") is None else f"{e['on_policy_gap']:.4f} (max {e['on_policy_gap_max']:.3f})"


def _name(r: dict[str, Any]) -> str:
    eos = ", EOS on" if r.get("eos") else ""
    kl = ", KL" if r.get("kl") else ""
    params = f" ({r['parameters'] / 1e9:.2f}B)" if r.get("parameters") else ""
    return f"{r['row']}: {r['shape']}{params} {r['mode']}, {r['rows']} x {r['length']}{eos}{kl}"


def _share(r: dict[str, Any], key: str, digits: int) -> str:
    """A share of the card, or why it is missing: above its physical bound, the timing cannot be right."""
    if key in r:
        return f"{r[key]:.{digits}%}"
    return "above 100%: not shown" if key in r.get("out_of_bound", []) else "-"


def _bandwidth(r: dict[str, Any]) -> str:
    return f"{_share(r, 'generation_share_of_bandwidth', 0)} ({r['decode_step_mb']:.0f} MB a step)"


def _utilisation(r: dict[str, Any]) -> str:
    recomputed = "update_hfu" in r and r["update_hfu"] != r.get("update_mfu")  # rows measured before HFU: MFU alone
    return _share(r, "update_mfu", 1) + (f" ({_share(r, 'update_hfu', 1)})" if recomputed else "")


def _trl_lines(r: dict[str, Any]) -> list[str]:
    lines = []
    for engine in ("ours", "trl"):
        e = r["engines"][engine]
        extra = (_bandwidth(r), _utilisation(r)) if engine == "ours" and "decode_step_mb" in r else ("", "")
        speed = f" (**{r['speedup_vs_trl']:.2f}x**)" if engine == "ours" else ""
        lines.append(f"| {_name(r)} | {_ours(e) if engine == 'ours' else r['trl_baseline']} | "
                     f"{_f(e['completion_tokens_per_s'])}{speed} | {_f(e['generation_tokens_per_s'])} | "
                     f"{_f(e['tokens'])} | {_memory(e, r)} | {_gap(e)} | {extra[0]} | {extra[1]} |")
    return lines


def table(report: dict[str, Any]) -> str:
    """The rows of a run as one table: the card and versions first, then each row with its distance from the card."""
    c, ceiling = report["card"], report.get("ceiling", {})
    lines = [f"{c['device']}; torch {c['torch']}, CUDA {c['cuda']}, transformers {c['transformers']}, TRL "
             f"{c.get('trl')}, torchao {c.get('torchao')}; measured ceilings {ceiling.get('bandwidth_gbs')} GB/s "
             f"copy, {ceiling.get('bf16_tflops')} TFLOP/s bf16 matmul; deterministic kernels "
             f"{'on' if report.get('deterministic') else 'off'} (the grpo stage's setting). vLLM cannot be "
             "installed on these machines.", "",
             "| row | engine | completion tokens/s (step) | generation tokens/s | completion tokens a step | "
             "peak GPU GB allocated / reserved (host RSS so far) | on-policy gap, nats (mean, max) | "
             "generation vs bandwidth floor | update MFU (HFU, recomputation counted) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report.get("rows", []):
        if "error" in r:
            lines.append(f"| {r.get('row')} {r.get('shape', '')} {r.get('mode', '')} | failed: {r['error'][:120]} "
                         "||||||||")
        elif r["row"] in TRL_ROWS:
            lines += _trl_lines(r)
        elif r["row"] in OURS_ROWS:
            o = r["ours"]
            ckpt = ", checkpointing" if o.get("gradient_checkpointing") else ""
            lines.append(f"| {_name(r)}{ckpt} | {_ours(o)} | {_f(o['completion_tokens_per_s'])} | "
                         f"{_f(o['generation_tokens_per_s'])} | {_f(o['tokens'])} | {_memory(o, r)} | {_gap(o)} | "
                         f"{_bandwidth(r)} | {_utilisation(r)} |")
        elif r["row"] == "compile_step":
            lines.append(f"| option: compile_step, {r['shape']} generation, 64 x {r['length']} | ours | | "
                         f"{_f(r['graphs']['generation_tokens_per_s'])} graphs; "
                         f"{_f(r['compiled']['generation_tokens_per_s'])} compiled (first step "
                         f"{r['compiled']['first_step_s']} s) | | | | | |")
        elif r["row"] == "heldout":
            trl = "" if r.get("trl") is None else (f", TRL {r['trl']:.3f} "
                                                   f"(ours - TRL {r['ours_minus_trl']['mean']:+.3f}"
                                                   f", CI {r['ours_minus_trl']['ci95_low']:+.3f} .. "
                                                   f"{r['ours_minus_trl']['ci95_high']:+.3f})")
            lines.append(f"| held-out, {r['mode']}, after {r['completions']:,} completions (n = {r['n']}, start "
                         f"{r['start']:.3f}) | ours {r['ours']:.3f}{trl} | | | | "
                         f"{_f(r.get('ours_peak_gpu_gb'), 1)} | | | |")
    return "\n".join(lines)


def gate_lines(report: dict[str, Any]) -> list[str]:
    g = report.get("gate")
    if not g:
        return []
    if not g.get("passed"):
        lines = [f"**Gate failed**: {g.get('why')}. No row was timed."]
        other = report.get("gate_without_determinism")
        if other:
            lines.append(f"Without the determinism setting: {'passed' if other.get('passed') else other.get('why')}.")
        return lines + [""]
    a = g.get("attention") or {}
    return [f"Gate passed in {g['seconds']} s: the door gave `{g['door_engine']}` in `{g['mode']}` mode for "
            f"{g['shape']} in {g['dtype']}; {g['graphs']} graphs captured in about {_f(g['capture_s'], 1)} s; "
            f"captured and eager greedy tokens agree over 32 steps; sampler vs trainer log-prob gap "
            f"{g['gap_mean']} nats on average (max {g['gap_max']})"
            + (f", vs the plain Hugging Face forward {g['plain_gap_mean']} (max {g['plain_gap_max']})"
               if "plain_gap_mean" in g else " (the plain forward not compared: a gate before that check)")
            + ". Masked bfloat16 attention runs "
            f"`{a.get('kernel')}` here (output "
            f"{'contiguous' if a.get('output_contiguous') else 'transposed in memory'}; backends that run it: "
            f"{', '.join(a.get('backends_that_run', []))}).", ""]


def markdown(report: dict[str, Any]) -> str:
    commands = report.get("commands") or [report["command"]]
    lines = ["# GPU rows (benchmarks/gpu_rows.py)", "", "; ".join(f"`{c}`" for c in commands), "",
             *gate_lines(report), table(report), ""]
    for note in report.get("notes", []):
        lines += [note, ""]
    if report.get("targets"):
        lines += ["| what | measured | target | met |", "|---|---:|---|---|"]
        lines += [f"| {t['what']} | {_f(t['value'], 2 if isinstance(t['value'], float) and t['value'] < 100 else 0)} "
                  f"| {t['target']} | {'yes' if t['met'] else 'no'} |" for t in report["targets"]]
        lines.append("")
    if report.get("gpu_tests"):
        lines += [f"GPU tests (`pytest -m gpu`, exit {report['gpu_tests']['exit']}): {report['gpu_tests']['summary']}",
                  ""]
    if report.get("skipped"):
        lines += ["Skipped: " + "; ".join(report["skipped"]), ""]
    return "\n".join(lines)
