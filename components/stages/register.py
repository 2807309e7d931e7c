"""Stage `register`: log the GRPO model to MLflow, register a version, and gate the `champion` alias.

Every new version gets alias `challenger`, and an RL model card as its description
(tracking/model_card.py). It becomes `champion` only when no `block` monitor was breached during GRPO
and either there is no champion yet and it beats its own starting point (the baseline the evaluate stage
measured: paired 95% CI low > 0 on `register.gate_metric`, unless `register.require_improvement: false`),
or on the same held-out set (same file hash) it beats the champion on `register.gate_metric`: mean paired
improvement over the champion's own per-prompt values > 0 with the bootstrap CI lower bound above
`register.min_ci_low`. Registration is keyed by the candidate's content hash, so re-running it
never creates a duplicate version.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from components.config import PipelineConfig, section_hash, to_flat_dict
from components.data.paths import Paths
from components.data.records import SPLITS, dir_md5, file_md5, read_jsonl, split_path
from components.engine.evaluation.heldout import paired_bootstrap
from components.engine.evaluation.task_metrics import metric_key
from components.engine.models.modeling import pick_device
from components.stages.cli import stage_main
from components.tracking.registry import current_tags
from components.tracking.run_environment import run_environment


def git_dirty_files(root: Path = Path(".")) -> str:
    """Tracked files that differ from HEAD (params.yaml after a --set run, typically), comma-separated."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                             text=True).stdout
    except FileNotFoundError:
        return ""
    return ",".join(sorted(line[3:] for line in out.splitlines() if line.strip()))[:5000]


def git_commit(root: Path = Path(".")) -> str:
    """HEAD's commit, suffixed `-dirty` when tracked files differ from it."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def dvc_lock_hashes(root: Path) -> dict[str, str]:
    """The md5 DVC recorded for every stage output (`dvc.<path>.md5`), as written to dvc.lock so far."""
    from components.config.loading import safe_load

    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    stages = (safe_load(lock.read_text()) or {}).get("stages", {})
    return {f"dvc.{out['path']}.md5": out["md5"] for stage in stages.values() for out in stage.get("outs", [])
            if "md5" in out}


def lineage_tags(cfg: PipelineConfig, paths: Paths, evaluation: dict[str, Any], candidate_md5: str) -> dict[str, str]:
    """What a registered version needs to recover its exact inputs and judge it."""
    tags = {f"data.{split}.md5": file_md5(split_path(paths.data, split)) for split in SPLITS}
    tags.update(dvc_lock_hashes(paths.root))
    lock = paths.root / "requirements.lock"
    tags.update({
        # Grouped by prefix, so the version page lists them together: eval.* (the evidence), lineage.*
        # (what to rebuild it from), data.*, dvc.*, env.* (registry_ops.LEGACY_TAGS: the names before).
        "lineage.lock_md5": file_md5(lock) if lock.exists() else "none",
        "lineage.git_dirty_files": git_dirty_files(paths.root), "lineage.git_commit": git_commit(paths.root),
        "lineage.params_hash": section_hash(cfg), "lineage.candidate_md5": candidate_md5,
        "eval.heldout_md5": evaluation["heldout_md5"], "eval.heldout_n": str(evaluation["n"]),
        "eval.heldout_mean_reward": f"{evaluation['candidate']['mean_reward']:.6f}",
        "eval.improvement": f"{evaluation['improvement']['mean']:.6f}",
        "eval.improvement_ci95_low": f"{evaluation['improvement']['ci95_low']:.6f}",
        "eval.improvement_ci95_high": f"{evaluation['improvement']['ci95_high']:.6f}",
    })
    tags.update(run_environment(cfg.threads, str(pick_device(cfg.device))))
    return tags


def evidence_tags(cfg: PipelineConfig, evaluation: dict[str, Any], grpo: dict[str, Any]) -> dict[str, str]:
    """Each task metric's result, the kept checkpoint and the monitors' verdicts, as version tags."""
    tags = {"eval.gate_metric": cfg.register.gate_metric}
    for metric, row in (evaluation.get("metrics") or {}).items():
        imp = row["improvement"]
        tags[f"eval.{metric_key(metric)}"] = (f"{row['candidate']:.4f} (before {row['baseline']:.4f}; "
                                              f"{imp['mean']:+.4f}, 95% CI {imp['ci95_low']:+.4f} .. "
                                              f"{imp['ci95_high']:+.4f})")
    kept = grpo.get("kept") or {}
    if kept:
        tags.update({"grpo.keep": str(kept.get("mode")), "grpo.kept_step": str(kept.get("step"))})
    for m in grpo.get("monitors") or []:
        b = m.get("breach")
        tags[f"monitor.{m['signal']}"] = (f"breached: {b['value']:.4g} at step {b['step']} ({m['rule']}, {m['action']})"
                                          if b else f"ok ({m['rule']}, {m['action']})")
    if grpo.get("not_learning"):
        tags["warning.not_learning"] = str(grpo["not_learning"])[:5000]
    return tags


def write_model_card(run, cfg: PipelineConfig, paths: Paths, name: str, version: str, evaluation: dict[str, Any],
                     decision: dict[str, Any], grpo: dict[str, Any], tags: dict[str, str],
                     predictions: list[dict[str, Any]]) -> str:
    """Log `model_card/model_card.md` (+ the held-out curve) to the register run; return the description card."""
    from components.tracking.model_card import model_card
    from components.tracking.reports import HELDOUT_CURVE

    figure = paths.plots / HELDOUT_CURVE
    url = f"get-artifact?path=model_card/{HELDOUT_CURVE}&run_uuid={run.run_id}" if figure.exists() else None
    full, short = model_card(cfg, name, version, evaluation, decision, grpo, tags, predictions, url)
    with tempfile.TemporaryDirectory() as tmp:
        card = Path(tmp) / "model_card.md"
        card.write_text(full.replace(f"]({url})", f"]({HELDOUT_CURVE})") if url else full)
        run.log_artifact(card, "model_card")
    if figure.exists():
        run.log_artifact(figure, "model_card")
    return short


def log_params_file(run, params_path: Path) -> None:
    """The exact params (even if never committed) as `lineage/params.yaml`, secret-looking values redacted."""
    import yaml

    from components.config.loading import load_yaml
    from components.tracking.runs import redact

    with tempfile.TemporaryDirectory() as tmp:
        safe = Path(tmp) / "params.yaml"
        safe.write_text(yaml.safe_dump(redact(load_yaml(params_path.read_text())), sort_keys=False))
        run.log_artifact(safe, "lineage")


def _champion(client, name: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, "champion")
    except MlflowException:
        return None


def champion_predictions(client, champion) -> dict[str, dict[str, Any]] | None:
    """The champion's per-prompt held-out results (id -> row of eval/predictions.jsonl), from its run's artifacts."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = client.download_artifacts(champion.run_id, "eval/predictions.jsonl", tmp)
        except Exception:  # noqa: BLE001 - a champion without predictions cannot be compared
            return None
        return {str(r["id"]): r for r in read_jsonl(local)}


def blocking_breaches(grpo: dict[str, Any]) -> list[dict[str, Any]]:
    """The monitors with `action: block` that GRPO found breached (metrics/grpo.json)."""
    return [m for m in grpo.get("monitors") or [] if m.get("breached") and m.get("action") == "block"]


def compare_with_champion(predictions: list[dict[str, Any]], theirs: dict[str, dict[str, Any]],
                          cfg: PipelineConfig) -> dict[str, dict[str, float]]:
    """Paired improvement over the champion on every metric both have per prompt."""
    ids = [str(p["id"]) for p in predictions]
    out = {}
    for metric in dict.fromkeys(["reward", *cfg.evaluate.metrics]):
        column = f"candidate_{metric}"
        if all(column in p for p in predictions) and all(column in theirs[i] for i in ids):
            out[metric] = paired_bootstrap(np.array([p[column] for p in predictions], dtype=float),
                                           np.array([theirs[i][column] for i in ids], dtype=float),
                                           cfg.evaluate.bootstrap_samples, cfg.seed)
    return out


def versus_baseline(evaluation: dict[str, Any], gate: str) -> dict[str, float] | None:
    """The paired improvement over the model GRPO started from on `gate`, as the evaluate stage measured it."""
    row = (evaluation.get("metrics") or {}).get(gate)
    if row is None and gate == "reward":
        return evaluation.get("improvement")
    return None if row is None else row["improvement"]


def _ci_text(cmp: dict[str, float]) -> str:
    return f"{cmp['mean']:+.4f} (95% CI {cmp['ci95_low']:+.4f} .. {cmp['ci95_high']:+.4f})"


def first_champion(evaluation: dict[str, Any], cfg: PipelineConfig) -> tuple[bool, str]:
    """With no champion yet: whether this version may take the alias, and the rule that decided."""
    gate = cfg.register.gate_metric
    cmp = versus_baseline(evaluation, gate)
    start = "its starting point (" + ("the SFT warm start" if cfg.sft.enabled else "the base model") + ")"
    if not cfg.register.require_improvement:
        return True, "no champion yet (register.require_improvement: false: the first version is champion " + (
            f"whatever it measured; against {start}: {_ci_text(cmp)})" if cmp else "whatever it measured)")
    if cmp is None:
        return False, (f"no champion yet, and no held-out {gate} against {start} to show it is better "
                       "(register.require_improvement: false promotes it anyway)")
    if cmp["ci95_low"] > 0:
        return True, f"no champion yet; beats {start} on held-out {gate}: {_ci_text(cmp)}"
    return False, (f"no better than {start} on held-out {gate}: {_ci_text(cmp)}, needs "
                   "CI low > 0 to become the first champion (register.require_improvement: false promotes it anyway)")


def decide(client, name: str, version: str, evaluation: dict[str, Any], predictions: list[dict[str, Any]],
           cfg: PipelineConfig, grpo: dict[str, Any] | None = None) -> dict[str, Any]:
    """Whether `version` should take the `champion` alias, and why.

    A `block` monitor breached during GRPO refuses it outright. Otherwise it becomes champion when there is
    none and it beats its own starting point (`first_champion`), or when on the same held-out set its paired
    improvement over the champion on `register.gate_metric` is > 0 with the CI's lower bound above
    `register.min_ci_low`. Either way the decision carries the comparison with the starting point.
    """
    decision = _decide(client, name, version, evaluation, predictions, cfg, grpo)
    return decision | {"vs_baseline": versus_baseline(evaluation, cfg.register.gate_metric)}


def _decide(client, name: str, version: str, evaluation: dict[str, Any], predictions: list[dict[str, Any]],
            cfg: PipelineConfig, grpo: dict[str, Any] | None = None) -> dict[str, Any]:
    gate = cfg.register.gate_metric
    blocked = blocking_breaches(grpo or {})
    refusal = ("monitor breached: " + "; ".join(
        f"{b['signal']} = {b['breach']['value']:.4g} at step {b['breach']['step']} (rule {b['signal']} {b['rule']})"
        for b in blocked) + " -> not promoted") if blocked else None
    champion = _champion(client, name)
    if champion is None:
        allowed, why = first_champion(evaluation, cfg)
        return {"promote": refusal is None and allowed, "reason": f"{refusal}; {why}" if refusal else why,
                "champion_version": None, "gate_metric": gate,
                "rule": "first version: must beat its starting point" if cfg.register.require_improvement
                else "first version: no improvement required (register.require_improvement: false)"}
    if str(champion.version) == str(version):
        return {"promote": True, "reason": "already champion", "champion_version": version, "gate_metric": gate,
                "rule": "already champion"}
    base = {"champion_version": champion.version, "gate_metric": gate}
    if current_tags(champion.tags).get("eval.heldout_md5") != evaluation["heldout_md5"]:
        return base | {"promote": False, "reason": refusal or (
            f"champion v{champion.version} was evaluated on a different held-out set "
            f"({current_tags(champion.tags).get('eval.heldout_md5')} vs {evaluation['heldout_md5']}); not comparable")}
    theirs = champion_predictions(client, champion)
    ids = [str(p["id"]) for p in predictions]
    if theirs is None or any(i not in theirs for i in ids):
        return base | {"promote": False, "reason": refusal or
                       f"champion v{champion.version} has no per-prompt held-out rewards"}
    versus = compare_with_champion(predictions, theirs, cfg)
    if gate not in versus:
        return base | {"promote": False, "vs_champion_metrics": versus, "reason": refusal or (
            f"champion v{champion.version} has no per-prompt held-out {gate} (register.gate_metric); not comparable")}
    cmp = versus[gate]
    base = base | {"rule": f"must beat champion v{champion.version} (register.min_ci_low {cfg.register.min_ci_low})"}
    wins = cmp["mean"] > 0 and cmp["ci95_low"] > cfg.register.min_ci_low
    verdict = "beats" if wins else "does not beat"
    reason = (f"{verdict} champion v{champion.version} on held-out {gate}: improvement {cmp['mean']:+.4f} "
              f"(95% CI {cmp['ci95_low']:+.4f} .. {cmp['ci95_high']:+.4f}, needs low > {cfg.register.min_ci_low})")
    if refusal:
        reason = f"{refusal}; it {reason}"
    return base | {"promote": bool(wins) and refusal is None, "vs_champion": cmp, "vs_champion_metrics": versus,
                   "reason": reason}


def register(cfg: PipelineConfig, paths: Paths = Paths()) -> dict[str, Any]:
    name = cfg.register.model_name
    evaluation = json.loads((paths.metrics / "eval.json").read_text())
    predictions = read_jsonl(paths.eval_dir / "predictions.jsonl")
    grpo_file = paths.metrics / "grpo.json"
    grpo = json.loads(grpo_file.read_text()) if grpo_file.exists() else {}
    candidate_md5 = dir_md5(paths.grpo_model)
    from components.locks import REGISTRY_LOCK, file_lock

    with file_lock(paths.root / REGISTRY_LOCK, "a registry change in this repository", wait_s=600):
        return _register_locked(cfg, paths, name, evaluation, predictions, candidate_md5, grpo)


def _register_locked(cfg: PipelineConfig, paths: Paths, name: str, evaluation: dict[str, Any],
                     predictions: list[dict[str, Any]], candidate_md5: str, grpo: dict[str, Any]) -> dict[str, Any]:
    from components.tracking.outbox import TrackingUnreachable
    from components.tracking.runs import client as mlflow_client
    from components.tracking.runs import send_queue, stage_run

    client = mlflow_client()
    if not send_queue(client):  # the runs an outage queued go first: the version's lineage names them
        raise TrackingUnreachable("the tracking records queued during an outage could not be sent")
    existing = []
    if client.search_registered_models(filter_string=f"name = '{name}'"):
        same = [v for v in client.search_model_versions(f"name = '{name}'")
                if current_tags(v.tags).get("lineage.candidate_md5") == candidate_md5]
        existing = [v for v in same if v.tags.get("registration") == "complete"]
        for half in (v for v in same if v.tags.get("registration") != "complete"):
            # A run killed mid-registration: the version never got its tags or aliases; remove it.
            client.delete_model_version(name, half.version)
            print(f"register: removed incomplete version {half.version} of {name} left by an interrupted run")
    with stage_run(cfg.tracking.experiment, "register", to_flat_dict(cfg)) as run:
        if existing:
            version = existing[0]
            print(f"register: candidate {candidate_md5} is already version {version.version}; not registering again")
        else:
            version = _new_version(client, run, cfg, paths, name, evaluation, candidate_md5, grpo)
        decision = decide(client, name, version.version, evaluation, predictions, cfg, grpo)
        for breach in blocking_breaches(grpo):
            print(f"register: monitor {breach['signal']} {breach['rule']} breached at step {breach['breach']['step']} "
                  f"(value {breach['breach']['value']:.4g}; action block): v{version.version} is not made champion")
        _apply_decision(client, run, name, str(version.version), decision)
        card = write_model_card(run, cfg, paths, name, str(version.version), evaluation, decision, grpo,
                                current_tags(version.tags), predictions)
        client.update_model_version(name, version.version, description=card)
    uri = f"models:/{name}/{version.version}"
    result = {"model_name": name, "version": str(version.version), "model_uri": uri, "promoted": decision["promote"],
              "reason": decision["reason"],
              "champion_version": (None if decision.get("champion_version") is None
                                   else str(decision["champion_version"])),
              "champion_uri": f"models:/{name}@champion", "candidate_md5": candidate_md5,
              "vs_champion": decision.get("vs_champion"), "vs_baseline": decision.get("vs_baseline"),
              "rule": decision.get("rule"), "gate_metric": cfg.register.gate_metric,
              "blocked_by": [b["signal"] for b in blocking_breaches(grpo)]}
    paths.metrics.mkdir(parents=True, exist_ok=True)
    (paths.metrics / "register.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"register: {uri} -> {'champion' if decision['promote'] else 'challenger'} ({decision['reason']})")
    print(comparison_line(result))
    return result


def _new_version(client, run, cfg: PipelineConfig, paths: Paths, name: str, evaluation: dict[str, Any],
                 candidate_md5: str, grpo: dict[str, Any]):
    """Log the candidate and register it as a new version with its lineage and evidence tags; marked complete only
    once its artifacts and tags are all in place."""
    import mlflow

    from components.engine.models.modeling import load_tokenizer
    from components.tracking.registered_model import log_trained_model, serving_config

    tags = lineage_tags(cfg, paths, evaluation, candidate_md5) | evidence_tags(cfg, evaluation, grpo)
    run.log_artifact(paths.eval_dir / "predictions.jsonl", "eval")
    run.log_artifact(paths.metrics / "eval.json")
    log_params_file(run, paths.root / "params.yaml")
    serving = serving_config(cfg, load_tokenizer(paths.grpo_model))
    with mlflow.start_run(run_id=run.run_id):
        info, model_tags = log_trained_model(client, name, paths.grpo_model, serving, cfg.register.merge_lora)
    tags.update(model_tags)
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        from mlflow.exceptions import MlflowException

        try:
            client.create_registered_model(name)
        except MlflowException:  # another repository's run created it meanwhile
            if not client.search_registered_models(filter_string=f"name = '{name}'"):
                raise
    version = client.create_model_version(name, info.model_uri, run_id=run.run_id, tags=tags,
                                          model_id=info.model_id)  # a tracking server requires it
    client.set_model_version_tag(name, version.version, "registration", "complete")
    return client.get_model_version(name, version.version)


def _apply_decision(client, run, name: str, version: str, decision: dict[str, Any]) -> None:
    """challenger always, champion when the decision promotes; every move recorded with who, when and why."""
    from components.tracking.registry import alias_version, move_alias

    aliases = [("challenger", f"registered by run {run.run_id}")]
    if decision["promote"]:
        aliases.append(("champion", decision["reason"]))
    for alias, why in aliases:  # champion keeps its history
        held = alias_version(client, name, alias)
        if held is None or str(held.version) != version:
            move_alias(client, name, alias, version, why, "register")
    verdict = "champion" if decision["promote"] else "challenger"
    for key, value in (("promotion.decision", verdict), ("promotion.reason", decision["reason"])):
        client.set_model_version_tag(name, version, key, value)
    run.set_tags({"promotion.decision": verdict, "promotion.reason": decision["reason"], "model_version": version})


def comparison_line(result: dict[str, Any]) -> str:
    """The two comparisons a promotion rests on, side by side: against the run's own start, against the champion."""
    if result["vs_champion"]:
        champion = f"{_ci_text(result['vs_champion'])} (v{result['champion_version']})"
    elif result["champion_version"] is None:
        champion = "none yet"
    elif str(result["champion_version"]) == str(result["version"]):
        champion = "this version is the champion"
    else:
        champion = f"v{result['champion_version']}, not comparable"
    start = _ci_text(result["vs_baseline"]) if result.get("vs_baseline") else "not measured"
    return f"register: held-out {result['gate_metric']}: vs its starting point {start}; vs the champion {champion}"


def main(argv: list[str] | None = None) -> int:
    return stage_main("Register the model in MLflow and gate the champion alias.", register, argv)


if __name__ == "__main__":
    sys.exit(main())
