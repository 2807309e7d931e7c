"""Registry operations people run by hand: promote, roll back, compare runs.

The `champion` alias only ever moves through `move_alias`, which records who moved it, when and
why (version tags `alias.<alias>.*`, and the registered-model tag `alias.audit`, a JSON list) and
keeps the stack of earlier champions in the registered-model tag `champion.history`, so `rollback` knows where to
go back to. Promotion applies the same comparability rule as `register`: a version without a held-out evaluation, or one
evaluated on a different held-out file than the current champion, is refused.
"""

from __future__ import annotations

import getpass
import json
import os
import time
from dataclasses import dataclass
from typing import Any

HISTORY_TAG = "champion.history"  # comma-separated earlier champions, oldest first
PREVIOUS_TAG = "champion.previous"  # the champion before the current one (the rollback target)
AUDIT_TAG = "alias.audit"  # JSON list of alias moves {alias, from, to, who, when, why, action}
AUDIT_MAX_CHARS = 5000  # MLflow's tag value limit on some stores
ACTOR_ENV = "GRPO_ACTOR"  # who is moving aliases (a CI job, a scheduler); defaults to the OS user


class RegistryRefused(RuntimeError):
    """A promotion or rollback that would break the registry's rules; the message says which and why."""


def actor() -> str:
    return os.environ.get(ACTOR_ENV) or getpass.getuser()


def _model_tags(client, name: str) -> dict[str, str]:
    from mlflow.exceptions import MlflowException

    try:
        return dict(client.get_registered_model(name).tags)
    except MlflowException as err:
        raise RegistryRefused(f"registered model '{name}' does not exist") from err


def _version(client, name: str, version: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version(name, str(version))
    except MlflowException as err:
        raise RegistryRefused(f"version {version} of '{name}' does not exist") from err


def alias_version(client, name: str, alias: str):
    """The version holding `alias`, or None."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def move_alias(client, name: str, alias: str, version: str, why: str, action: str,
               who: str | None = None) -> dict[str, Any]:
    """Point `alias` at `version`, recording who/when/why; for `champion`, push the old one on the history."""
    who = who or actor()
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    old = alias_version(client, name, alias)
    old_version = None if old is None else str(old.version)
    client.set_registered_model_alias(name, alias, str(version))
    for key, value in (("set_by", who), ("set_at", when), ("reason", why), ("action", action)):
        client.set_model_version_tag(name, str(version), f"alias.{alias}.{key}", value)
    record = {"alias": alias, "from": old_version, "to": str(version), "who": who, "when": when, "why": why,
              "action": action}
    append_audit(client, name, record)
    if alias == "champion" and old_version not in (None, str(version)) and action != "rollback":
        history = [v for v in _model_tags(client, name).get(HISTORY_TAG, "").split(",") if v]
        client.set_registered_model_tag(name, HISTORY_TAG, ",".join(history + [old_version]))
        client.set_registered_model_tag(name, PREVIOUS_TAG, old_version)
    return record


def audit_log(client, name: str) -> list[dict[str, Any]]:
    """Every recorded alias move of the model, oldest first."""
    return json.loads(_model_tags(client, name).get(AUDIT_TAG) or "[]")


def append_audit(client, name: str, record: dict[str, Any]) -> None:
    """Add one move to the model's audit tag; the oldest entries go when the tag would exceed its size limit."""
    log = audit_log(client, name) + [record]
    text = json.dumps(log, sort_keys=True)
    while len(text) > AUDIT_MAX_CHARS and len(log) > 1:
        log = log[1:]
        text = json.dumps(log, sort_keys=True)
    client.set_registered_model_tag(name, AUDIT_TAG, text)


# Version tags as named before they were grouped by prefix (versions registered earlier still carry them).
LEGACY_TAGS = {"eval.heldout_md5": "heldout_md5", "eval.heldout_n": "heldout_n",
               "eval.heldout_mean_reward": "heldout_mean_reward", "eval.improvement": "improvement_vs_baseline",
               "eval.improvement_ci95_low": "improvement_ci95_low",
               "eval.improvement_ci95_high": "improvement_ci95_high",
               "lineage.candidate_md5": "candidate_md5", "lineage.params_hash": "params_hash",
               "lineage.lock_md5": "lock_md5", "lineage.git_commit": "git_commit",
               "lineage.git_dirty_files": "git_dirty_files"}


def current_tags(tags: dict[str, str]) -> dict[str, str]:
    """A version's tags under today's names, whichever names it was registered with."""
    merged = dict(tags)
    for new, old in LEGACY_TAGS.items():
        if new not in merged and old in merged:
            merged[new] = merged[old]
    return merged


def check_promotable(client, name: str, version) -> None:
    """Refuse a version that is half-registered, lacks a held-out evaluation, or is not comparable."""
    tags = current_tags(version.tags)
    if tags.get("registration") != "complete":
        raise RegistryRefused(f"version {version.version} of '{name}' is not a complete registration "
                              f"(an interrupted `register`); it cannot be promoted")
    missing = [k for k in ("eval.heldout_md5", "eval.heldout_mean_reward") if not tags.get(k)]
    if missing:
        raise RegistryRefused(f"version {version.version} of '{name}' has no held-out evaluation "
                              f"(tags {', '.join(missing)} missing); evaluate it with the pipeline before promoting")
    champion = alias_version(client, name, "champion")
    if champion is not None and str(champion.version) != str(version.version):
        theirs = current_tags(champion.tags).get("eval.heldout_md5")
        if theirs != tags["eval.heldout_md5"]:
            raise RegistryRefused(
                f"version {version.version} of '{name}' was evaluated on a different held-out dataset "
                f"(md5 {tags['eval.heldout_md5']}) than champion v{champion.version} (md5 {theirs}); "
                f"their rewards are not comparable, so it is not promoted")


def promote(client, name: str, version: str, why: str) -> dict[str, Any]:
    """Make `version` the champion (after `check_promotable`)."""
    target = _version(client, name, version)
    check_promotable(client, name, target)
    current = alias_version(client, name, "champion")
    if current is not None and str(current.version) == str(version):
        raise RegistryRefused(f"version {version} of '{name}' is already the champion")
    return move_alias(client, name, "champion", str(version), why, "promote")


def rollback(client, name: str, why: str) -> dict[str, Any]:
    """Give `champion` back to the previous champion (popped from `champion.history`)."""
    tags = _model_tags(client, name)
    history = [v for v in tags.get(HISTORY_TAG, "").split(",") if v]
    current = alias_version(client, name, "champion")
    while history:
        target = history.pop()
        try:
            version = client.get_model_version(name, target)
        except Exception:  # noqa: BLE001 - a deleted version is skipped, the next older one is tried
            continue
        if current is not None and str(current.version) == target:
            continue
        check_promotable_for_rollback(name, version)
        record = move_alias(client, name, "champion", target, why, "rollback")
        client.set_registered_model_tag(name, HISTORY_TAG, ",".join(history))
        client.set_registered_model_tag(name, PREVIOUS_TAG, history[-1] if history else "")
        return record
    raise RegistryRefused(f"'{name}' has no previous champion to roll back to (tag {HISTORY_TAG} is empty)")


def check_promotable_for_rollback(name: str, version) -> None:
    """A rollback goes back to a version that was champion: it only has to be complete and evaluated."""
    if version.tags.get("registration") != "complete" or not current_tags(version.tags).get("eval.heldout_md5"):
        raise RegistryRefused(f"previous champion v{version.version} of '{name}' lacks a complete registration "
                              f"or a held-out evaluation; not rolled back")


# --------------------------------------------------------------------------- compare

@dataclass
class RunSummary:
    run_id: str
    name: str
    status: str
    params: dict[str, str]
    metrics: dict[str, float]
    tags: dict[str, str]
    seconds: float | None


def pipeline_runs(client, experiment: str, run_ids: list[str] | None = None, last: int = 5) -> list[RunSummary]:
    """The pipeline parent runs to compare: the given ids, or the `last` newest of the experiment."""
    exp = client.get_experiment_by_name(experiment)
    if run_ids:
        runs = [resolve_run(client, exp, r) for r in run_ids]
    else:
        if exp is None:
            raise RegistryRefused(f"experiment '{experiment}' does not exist")
        runs = client.search_runs([exp.experiment_id], filter_string="tags.`grpo.stage` = 'pipeline'",
                                  order_by=["attributes.start_time DESC"], max_results=last)
    out = []
    for r in runs:
        end, start = r.info.end_time, r.info.start_time
        out.append(RunSummary(r.info.run_id, r.info.run_name or "", r.info.status, dict(r.data.params),
                              dict(r.data.metrics), dict(r.data.tags),
                              (end - start) / 1000.0 if end and start else None))
    return out


def resolve_run(client, experiment, run_id: str):
    """A run by its full id or by a prefix of it (the 12 characters `compare` prints), in `experiment`."""
    from mlflow.exceptions import MlflowException

    if len(run_id) == 32:
        try:
            return client.get_run(run_id)
        except MlflowException as err:
            raise RegistryRefused(f"no run {run_id} in this tracking store") from err
    if experiment is None or len(run_id) < 4:
        raise RegistryRefused(f"no run {run_id!r}: give at least 4 characters of an id from experiment "
                              f"'{getattr(experiment, 'name', '?')}'")
    matches = [r for r in client.search_runs([experiment.experiment_id], max_results=50000)
               if r.info.run_id.startswith(run_id)]
    if len(matches) != 1:
        raise RegistryRefused(f"run id prefix {run_id!r} matches {len(matches)} runs in experiment "
                              f"'{experiment.name}'" + ("; give more characters" if matches else ""))
    return matches[0]


def compare_table(runs: list[RunSummary]) -> str:
    """Rows: the params that differ, held-out rewards with the improvement's CI, data hashes, durations."""
    if not runs:
        raise RegistryRefused("no pipeline runs to compare")

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    rows: list[tuple[str, list[str]]] = [("run", [r.run_id[:12] for r in runs]), ("status", [r.status for r in runs])]
    keys = sorted({k for r in runs for k in r.params})
    differing = [k for k in keys if len({r.params.get(k) for r in runs}) > 1]
    rows += [(f"param {k}", [r.params.get(k, "-") for r in runs]) for k in differing]
    rows.append(("held-out reward before", [fmt(r.metrics.get("baseline_mean_reward")) for r in runs]))
    rows.append(("held-out reward after", [fmt(r.metrics.get("candidate_mean_reward")) for r in runs]))
    def ci(r: RunSummary, prefix: str) -> str:
        m = r.metrics
        if f"{prefix}_mean" not in m:
            return "-"
        return (f"{m[f'{prefix}_mean']:+.4f} ({m.get(f'{prefix}_ci95_low', float('nan')):+.4f} .. "
                f"{m.get(f'{prefix}_ci95_high', float('nan')):+.4f})")

    rows.append(("vs its start (95% CI)", [ci(r, "improvement") for r in runs]))
    rows.append(("vs champion (95% CI)", [
        ci(r, "vs_champion") if "vs_champion_mean" in r.metrics else
        "none yet" if r.tags.get("promotion.champion_version") == "none" else "-" for r in runs]))
    rows.append(("promotion", [r.tags.get("promotion.decision", "-") for r in runs]))
    data_keys = sorted({k for r in runs for k in r.tags if k.startswith("data.") and k.endswith(".md5")})
    rows += [(k, [r.tags.get(k, "-")[:12] for r in runs]) for k in data_keys]
    rows.append(("model version", [r.tags.get("model_version", "-") for r in runs]))
    rows.append(("duration", ["-" if r.seconds is None else f"{r.seconds:.1f}s" for r in runs]))
    width = max(len(label) for label, _ in rows)
    cols = [max(len(row[1][i]) for row in rows) for i in range(len(runs))]
    lines = []
    for n, (label, values) in enumerate(rows):
        lines.append(label.ljust(width) + "  " + "  ".join(v.ljust(c) for v, c in zip(values, cols)))
        if n == 0:
            lines.append("-" * len(lines[0]))
    if not differing:
        lines.append("(all params are equal)")
    return "\n".join(lines)
