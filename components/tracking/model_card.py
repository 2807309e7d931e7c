"""The RL model card of a registered version: what it was trained from and how, what the evidence says.

Written twice: in full as the `model_card.md` artifact of the register run, and as the version's
description (the MLflow model version page renders its Markdown), which a SQL registry caps at 5,000
characters: the description keeps every section but the samples, and links the full card.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any

from components.config import PipelineConfig
from components.engine.rewards.rewards import resolve_reward

DESCRIPTION_LIMIT = 5000  # model_versions.description is VARCHAR(5000) in MLflow's SQL stores


def reward_source_hash(name: str) -> str:
    """sha256 (first 16 hex digits) of a reward function's source: which code scored the completions."""
    return _source_hash(lambda: resolve_reward(name))


def _source_hash(resolve) -> str:
    try:
        source = inspect.getsource(resolve())
    except (OSError, TypeError, KeyError, ImportError, AttributeError) as err:
        return f"unavailable ({type(err).__name__})"
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def episodes_lines(cfg: PipelineConfig) -> list[str]:
    """The card's lines on tools or an environment: which code answered the model (sources' hashes), the limits, each
    tool it was trained with (name, import path, description, parameters) and how the served model answers."""
    g = cfg.grpo
    if not (g.tools or g.environment):
        return []
    from components.engine.generation.environments.tools import BUILTIN_TOOLS, load_tools
    from components.user_code import load_callable

    kind, names, known = ("tools", g.tools, BUILTIN_TOOLS) if g.tools else ("environment", [g.environment], {})
    listed = "; ".join(f"`{n}` (source sha256 `{_source_hash(lambda n=n: load_callable(n, known, kind))}`)"
                       for n in names)
    lines = [f"- Episodes with {kind}: {listed}; at most {g.episode.max_turns} model turns and "
             f"{g.max_completion_length} tokens after the prompt, {g.episode.timeout_s:g} s a call"]
    if not g.tools:
        return lines + ["- Serving: answers OpenAI-style chat requests (`messages`) one model turn at a time; the "
                        "environment is not served (the client sends what it would answer)"]
    lines.append("- Tools it was trained with (offered by the served model when a chat request lists no `tools`):")
    for tool in load_tools(g.tools):
        function = tool.schema["function"]
        lines.append(f"  - `{tool.name}` (`{tool.function.__module__}:{tool.function.__qualname__}`): "
                     f"{_cell(function.get('description', ''), 200)}; parameters "
                     f"`{json.dumps(function.get('parameters', {}), sort_keys=True)}`")
    return lines + ["- Serving: answers OpenAI-style chat requests (`messages`, `tools`) with training's chat layout "
                    "and call parser: a call comes back in `tool_calls` for the client to run (its result sent back "
                    "as a `tool` message), a plain answer in `content`"]


def _ci(imp: dict[str, float] | None) -> str:
    if not imp:
        return "-"
    return f"{imp['mean']:+.4f} ({imp['ci95_low']:+.4f} .. {imp['ci95_high']:+.4f})"


def _cell(text: Any, limit: int = 60) -> str:
    text = str(text).replace("|", "\\|").replace("\n", "⏎")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def model_card(cfg: PipelineConfig, name: str, version: str, evaluation: dict[str, Any], decision: dict[str, Any],
               grpo: dict[str, Any], tags: dict[str, str], predictions: list[dict[str, Any]],
               figure_url: str | None) -> tuple[str, str]:
    """(full card, description-sized card) in Markdown."""
    verdict = "champion" if decision["promote"] else "challenger"
    head = [f"## Model card: {name} v{version}", "",
            f"**Decision: {verdict}.** {decision['reason']}.", ""]
    if decision.get("rule"):
        head += [f"Rule: {decision['rule']}.", ""]
    evidence = _evidence(cfg, evaluation, decision)
    training, monitors = _training(cfg, grpo, tags), _monitors(grpo)
    curve, limits = _curve(grpo, figure_url), _limits(grpo)
    full = "\n".join(head + evidence + training + monitors + curve + _samples(predictions) + limits)
    link = ["Full card, with sample completions: artifact `model_card/model_card.md` of the register run."]
    short = "\n".join(head + evidence + training + monitors + curve + limits + link)
    if len(short) > DESCRIPTION_LIMIT:
        short = "\n".join(head + evidence + monitors + link)[:DESCRIPTION_LIMIT]
    return full, short


def _evidence(cfg: PipelineConfig, evaluation: dict[str, Any], decision: dict[str, Any]) -> list[str]:
    """The held-out table: each metric before GRPO, now, the improvement and the comparison with the champion."""
    e = cfg.evaluate
    metrics = evaluation.get("metrics") or {"reward": {
        "baseline": evaluation["baseline"]["mean_reward"], "candidate": evaluation["candidate"]["mean_reward"],
        "improvement": evaluation["improvement"]}}
    vs_champion = decision.get("vs_champion_metrics") or {}
    champion = decision.get("champion_version")
    evidence = [f"### Held-out evaluation (n = {evaluation['n']}, held-out md5 `{evaluation['heldout_md5'][:12]}`)", "",
                "| metric | before GRPO | this version | improvement (95% CI) | "
                + (f"vs champion v{champion} (95% CI) |" if champion and vs_champion else "vs champion |"),
                "|---|---|---|---|---|"]
    order = [cfg.register.gate_metric, "reward", *cfg.evaluate.metrics]
    for metric, row in sorted(metrics.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
        gate = " (gate)" if metric == cfg.register.gate_metric else ""
        evidence.append(f"| {metric}{gate} | {row['baseline']:.4f} | {row['candidate']:.4f} | "
                        f"{_ci(row['improvement'])} | {_ci(vs_champion.get(metric))} |")
    return evidence + ["", "CIs: paired bootstrap over prompts, "
                       f"{e.bootstrap_samples} resamples; pass@k at temperature {e.pass_k_temperature:g}.", ""]


def _training(cfg: PipelineConfig, grpo: dict[str, Any], tags: dict[str, str]) -> list[str]:
    """Base model, data and weights hashes, the algorithm's settings, the rewards with their sources' hashes."""
    g = cfg.grpo
    base_id = cfg.model.name_or_path or "the tiny default (model.tiny, random init)"
    training = ["### Training", "",
                f"- Base model: {base_id}; models/base md5 `{tags.get('dvc.models/base.md5', '-')}`",
                f"- Warm start (models/sft) md5 `{tags.get('dvc.models/sft.md5', '-')}`; "
                f"GRPO model md5 `{tags.get('lineage.candidate_md5', '-')}`",
                "- Data (DVC hashes): " + ", ".join(f"{split} `{tags.get(f'data.{split}.md5', '-')[:12]}`"
                                                     for split in ("sft", "train", "heldout")),
                f"- Algorithm: {g.algorithm}, {g.steps} steps x {g.prompts_per_step} prompts x G = {g.group_size}, "
                f"lr {g.learning_rate:g}, KL beta {g.kl_beta:g} ({g.kl_estimator}), loss {g.loss_type}, "
                f"epsilon {g.epsilon:g}, temperature {g.temperature:g}, max {g.max_completion_length} tokens"
                + (f", LoRA rank {g.lora.rank}" if g.lora.enabled else ", full fine-tuning"),
                "- Rewards: " + "; ".join(f"`{r.name}` x {r.weight:g} (source sha256 `{reward_source_hash(r.name)}`)"
                                          for r in g.rewards), *episodes_lines(cfg)]
    kept = grpo.get("kept") or {}
    if kept:
        value = kept.get("value")
        training.append(f"- Kept weights: `{kept.get('mode')}` -> step {kept.get('step')}"
                        + (f" (held-out {kept.get('metric')} {value:.4f})" if isinstance(value, (int, float)) else ""))
    training.append(f"- Commit `{tags.get('lineage.git_commit', '-')}`, "
                    f"params hash `{tags.get('lineage.params_hash', '-')}`")
    return training + [""]


def _monitors(grpo: dict[str, Any]) -> list[str]:
    """Each reward-hacking monitor's verdict, the not-learning warning and the generalisation verdict."""
    monitors = ["### Reward-hacking monitors", "", "| signal | rule | action | result |", "|---|---|---|---|"]
    for m in grpo.get("monitors") or []:
        b = m.get("breach")
        result = (f"**breached** at step {b['step']} ({b['value']:.4g})" if b else
                  "ok" + (f" (last {m['last_value']:.4g})" if isinstance(m.get("last_value"), (int, float)) else
                          " (not computed)"))
        monitors.append(f"| {m['signal']} | {m['rule']} | {m['action']} | {result} |")
    if not grpo.get("monitors"):
        monitors.append("| - | - | - | no monitors configured |")
    monitors += ["", f"Not-learning warning: {grpo.get('not_learning') or 'none'}."]
    if (grpo.get("generalisation") or {}).get("text"):
        monitors.append(f"Generalisation (training reward vs the held-out curve): {grpo['generalisation']['text']}.")
    return monitors + [""]


def _curve(grpo: dict[str, Any], figure_url: str | None) -> list[str]:
    """The held-out evaluations during training: the figure and at most a dozen rows of the table."""
    curve = ["### Evaluation during training", ""]
    evals = grpo.get("heldout_evaluations") or []
    if figure_url:
        curve += [f"![held-out metrics during training]({figure_url})", ""]
    if evals:
        keys = [k for k in evals[-1] if k != "step"]
        curve += ["| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        shown = evals if len(evals) <= 12 else evals[:: max(1, len(evals) // 10)] + [evals[-1]]
        curve += [f"| {r['step']} | " + " | ".join(f"{r[k]:.3f}" if k in r else "-" for k in keys) + " |"
                  for r in shown]
    else:
        curve.append("No held-out evaluation during training (evaluate.every: 0).")
    return curve + [""]


def _samples(predictions: list[dict[str, Any]]) -> list[str]:
    samples = ["### Sample held-out completions", "", "| prompt | answer | before GRPO | this version | reward |",
               "|---|---|---|---|---|"]
    samples += [f"| {_cell(p['prompt'])} | {_cell(p.get('answer'))} | {_cell(p.get('baseline_completion'))} | "
                f"{_cell(p.get('candidate_completion'))} | {p.get('candidate_reward', 0):.2f} |"
                for p in predictions[:5]]
    return samples + [""]


def _limits(grpo: dict[str, Any]) -> list[str]:
    limits = ["### Known limits", "",
              "- Measured on held-out prompts of the training task's own distribution: not an evaluation of "
              "safety, general ability, or other tasks.",
              "- The reward and the task metrics are the configured functions; a model can still satisfy them "
              "without solving the task in the intended way (read the samples).",
              "- CPU and GPU kernels differ: a rerun elsewhere gives a close, not identical, model."]
    if (grpo.get("kept") or {}).get("mode") == "best":
        limits.append("- `grpo.keep: best` picked the step on held-out prompts this evaluation also scores, so the "
                      "improvement over the baseline is optimistic by that selection.")
    return limits + [""]
