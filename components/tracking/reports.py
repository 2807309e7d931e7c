"""Pictures and tables for people, kept out of the training loop's code.

- `GRPOReporter`: fed once per GRPO step; every `reports.samples_every` steps it logs a table of
  sampled completions (prompt, completion, reward per component, total, advantage) with
  `log_table`, so they can be browsed in the MLflow UI; at the end it draws the reward curve and the
  per-group reward distribution as PNGs into `plots/` (DVC plots: images render offline) and logs
  them to the run. After a resume, the curves cover every step (from the checkpointed history) and
  the group distribution the steps run since the resume.
- `log_predictions_table`: evaluate's held-out predictions as an MLflow table.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from components.config import ReportsConfig

REWARD_CURVE = "grpo_reward.png"
GROUP_REWARDS = "grpo_group_rewards.png"
TRAINING_CURVES = "grpo_training.png"
HELDOUT_CURVE = "grpo_heldout.png"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


class GRPOReporter:
    """Collects what the figures and sample tables need, step by step; never touches training state."""

    def __init__(self, run, tokenizer, reports: ReportsConfig, transcripts: Callable[[Any], list[str]]):
        """`transcripts(rollouts)`: what a person reads of each row (the generation's reading)."""
        self.run, self.tokenizer, self.transcripts = run, tokenizer, transcripts
        self.samples_every, self.samples_rows = reports.samples_every, reports.samples_rows
        self.group_means: list[tuple[int, list[float]]] = []  # (step, mean reward of each group)

    def on_step(self, step: int, rollout, scores, advantages, final: bool = False) -> None:
        totals = list(scores.total)
        g = rollout.group_size
        self.group_means.append((step, [sum(totals[i:i + g]) / g for i in range(0, len(totals) - g + 1, g)]))
        due = self.samples_every and (step % self.samples_every == 0 or final)
        if due and len(rollout):
            self.log_samples(step, rollout, scores, advantages)

    def samples_text(self, rollout, scores, groups: int = 2) -> str:
        """The first completion of the first `groups` groups with its score, one line each (for a warning)."""
        rows = [rollout.group_rows([i])[0] for i in range(min(groups, rollout.num_groups))]
        part = rollout.select(rows)
        prompts = [self.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
                   for ids, mask in zip(part.prompt_ids.cpu(), part.prompt_mask.cpu())]
        scored = [scores.total[i] if i < len(scores.total) else None for i in rows]
        completions = self.transcripts(part)
        return "\n".join(f"  sample: {prompt[-120:]!r} -> {completion[:200]!r} (reward {score})"
                         for prompt, completion, score in zip(prompts, completions, scored))

    def sample_rows(self, rollout, scores, advantages) -> dict[str, list[Any]]:
        """Columns of the sample table: whole groups, first `samples_rows` completions of the step."""
        size = rollout.group_size
        n = min(len(rollout), max(size, self.samples_rows // size * size))
        part = rollout.select(list(range(n)))
        prompts = [self.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
                   for ids, mask in zip(part.prompt_ids.cpu(), part.prompt_mask.cpu())]
        table: dict[str, list[Any]] = {"group": [i // size for i in range(n)], "prompt": prompts,
                                       "completion": self.transcripts(part)}
        if len(scores.total) == len(rollout):  # rows line up with the scored round (no dynamic sampling)
            for name, values in scores.components.items():
                table[f"reward/{name}"] = [None if v is None else float(v) for v in values[:n]]
            table["reward"] = [float(v) for v in scores.total[:n]]
        table["advantage"] = [float(a) for a in advantages[:n].tolist()]
        return table

    def log_samples(self, step: int, rollout, scores, advantages) -> None:
        table = self.sample_rows(rollout, scores, advantages)
        rows = [{"step": step, **dict(zip(table, values))} for values in zip(*table.values())]
        self.run.log_table(rows, f"samples/step_{step:06d}.json")

    def finish(self, history: list[dict[str, Any]], plots_dir: Path) -> list[Path]:
        """Write the PNGs (DVC plots) and log them to the run."""
        files = write_step_figures(history, self.group_means, plots_dir)
        for path in files:
            self.run.log_artifact(path, "figures")
        return files


def write_step_figures(history: list[dict[str, Any]], group_means: list[tuple[int, list[float]]],
                       plots_dir: Path) -> list[Path]:
    """Reward curve (mean ± std per step), loss/KL curves, and per-group reward distributions."""
    plt = _pyplot()
    plots_dir.mkdir(parents=True, exist_ok=True)
    steps = [h["step"] for h in history]
    mean = [h["reward_mean"] for h in history]
    std = [h.get("reward_std", 0.0) for h in history]

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, mean, label="reward mean", color="tab:blue")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2,
                    color="tab:blue", label="± std")
    if len(mean) >= 5:
        k = max(2, len(mean) // 20)
        smooth = [sum(mean[max(0, i - k + 1): i + 1]) / len(mean[max(0, i - k + 1): i + 1]) for i in range(len(mean))]
        ax.plot(steps, smooth, color="black", lw=1.5, label=f"moving mean ({k} steps)")
    ax.set(xlabel="step", ylabel="reward", title="GRPO reward per step")
    ax.legend(loc="lower right")
    fig.tight_layout()
    curve = plots_dir / REWARD_CURVE
    fig.savefig(curve)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), dpi=100)
    for ax, key in zip(axes, ("loss", "kl")):
        ax.plot(steps, [h.get(key, 0.0) for h in history], color="tab:red" if key == "kl" else "tab:green")
        ax.set(xlabel="step", title=key)
    fig.tight_layout()
    training = plots_dir / TRAINING_CURVES
    fig.savefig(training)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    buckets = _buckets(group_means, 10)
    if buckets:
        ax.boxplot([values for _, values in buckets], tick_labels=[label for label, _ in buckets])
    ax.set(xlabel="steps", ylabel="mean reward of a group", title="Per-group reward distribution")
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    groups = plots_dir / GROUP_REWARDS
    fig.savefig(groups)
    plt.close(fig)
    return [curve, training, groups, heldout_figure(history, plots_dir / HELDOUT_CURVE)]


def heldout_figure(history: list[dict[str, Any]], path: Path) -> Path:
    """The held-out evaluations during training (evaluate.every) against the step, with the training reward
    for comparison: a held-out curve that falls while the training reward rises is reward hacking's mark."""
    plt = _pyplot()
    rows = [h for h in history if any(k.startswith("heldout/") for k in h)]
    keys = sorted(k for k in {k for h in rows for k in h if k.startswith("heldout/")} - {"heldout/completion_length"}
                  if not k.endswith("_se"))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for key in keys:
        ax.plot([h["step"] for h in rows if key in h], [h[key] for h in rows if key in h], marker="o",
                label=key.removeprefix("heldout/") + " (held-out)")
    if history:
        k = max(1, len(history) // 20)
        steps = [h["step"] for h in history]
        mean = [h["reward_mean"] for h in history]
        smooth = [sum(mean[max(0, i - k + 1): i + 1]) / len(mean[max(0, i - k + 1): i + 1]) for i in range(len(mean))]
        ax.plot(steps, smooth, color="grey", lw=1, label=f"training reward ({k}-step mean)")
    if not rows:
        ax.text(0.5, 0.5, "no held-out evaluation during training (evaluate.every: 0)", ha="center",
                transform=ax.transAxes)
    ax.set(xlabel="step", ylabel="value", title="Held-out metrics during GRPO")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _buckets(group_means: list[tuple[int, list[float]]], n: int) -> list[tuple[str, list[float]]]:
    """Consecutive steps pooled into at most `n` boxes, labelled by their step range."""
    if not group_means:
        return []
    size = max(1, -(-len(group_means) // n))
    out = []
    for i in range(0, len(group_means), size):
        chunk = group_means[i:i + size]
        values = [v for _, vs in chunk for v in vs]
        if values:
            first, last = chunk[0][0], chunk[-1][0]
            out.append((f"{first}" if first == last else f"{first}-{last}", values))
    return out


def log_predictions_table(run, rows: list[dict[str, Any]]) -> None:
    """Held-out predictions (prompt, answer, both completions and rewards) as a browsable MLflow table."""
    run.log_table(rows, "eval/heldout_predictions.json")


def log_data_docs(run, results: dict[str, Any]) -> None:
    """Great Expectations data docs (GX's own HTML rendering) of each file's validation, as run artifacts.

    Rendered from the first chunk of each file (all of it unless the file exceeds one chunk); the
    row-level result of every chunk is in metrics/validation.json.
    """
    import tempfile

    from great_expectations.render.renderer import ValidationResultsPageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "data_docs"
        out.mkdir()
        links = []
        for split, result in results.items():
            html = DefaultJinjaPageView().render(ValidationResultsPageRenderer().render(result))
            (out / f"{split}.html").write_text(html)
            status = "passed" if result.success else "FAILED"
            links.append(f'<li><a href="{split}.html">{split}</a>: {status}</li>')
        (out / "index.html").write_text("<html><body><h1>Great Expectations data docs</h1><ul>"
                                        + "".join(links) + "</ul></body></html>\n")
        run.log_artifact(out, "data_docs")
