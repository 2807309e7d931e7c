"""Stage `register`: log the GRPO model to MLflow, register a version, and gate the `champion` alias.

Every new version gets alias `challenger`. It becomes `champion` only when there is no champion yet,
or when on the same held-out set (same file hash) it beats the champion: mean paired improvement
over the champion's own per-prompt rewards > 0 with the bootstrap CI lower bound above
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
from components.engine.heldout import paired_bootstrap
from components.engine.modeling import pick_device
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
    import yaml

    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
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


def version_description(evaluation: dict[str, Any], decision: dict[str, Any]) -> str:
    """The first lines a model version page shows: its held-out result and the promotion decision."""
    imp = evaluation["improvement"]
    return (f"Held-out mean reward {evaluation['candidate']['mean_reward']:.4f} (before GRPO "
            f"{evaluation['baseline']['mean_reward']:.4f}; improvement {imp['mean']:+.4f}, 95% CI "
            f"{imp['ci95_low']:+.4f} .. {imp['ci95_high']:+.4f}, n = {evaluation['n']}).\n\n"
            f"Decision: {'champion' if decision['promote'] else 'challenger'}: {decision['reason']}.\n\n"
            "Lineage (data and model hashes, commit, environment) is in the tags.")


def log_params_file(run, params_path: Path) -> None:
    """The exact params (even if never committed) as `lineage/params.yaml`, secret-looking values redacted."""
    import yaml

    from components.tracking.runs import redact

    with tempfile.TemporaryDirectory() as tmp:
        safe = Path(tmp) / "params.yaml"
        safe.write_text(yaml.safe_dump(redact(yaml.safe_load(params_path.read_text())), sort_keys=False))
        run.log_artifact(safe, "lineage")


def _champion(client, name: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, "champion")
    except MlflowException:
        return None


def champion_rewards(client, champion) -> dict[str, float] | None:
    """The champion's per-prompt held-out rewards (id -> reward), from its run's artifacts."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = client.download_artifacts(champion.run_id, "eval/predictions.jsonl", tmp)
        except Exception:  # noqa: BLE001 - a champion without predictions cannot be compared
            return None
        return {str(r["id"]): float(r["candidate_reward"]) for r in read_jsonl(local)}


def decide(client, name: str, version: str, evaluation: dict[str, Any], predictions: list[dict[str, Any]],
           cfg: PipelineConfig) -> dict[str, Any]:
    """Whether `version` should take the `champion` alias, and why."""
    champion = _champion(client, name)
    if champion is None:
        return {"promote": True, "reason": "no champion yet", "champion_version": None}
    if str(champion.version) == str(version):
        return {"promote": True, "reason": "already champion", "champion_version": version}
    base = {"champion_version": champion.version}
    if current_tags(champion.tags).get("eval.heldout_md5") != evaluation["heldout_md5"]:
        return base | {"promote": False, "reason": (
            f"champion v{champion.version} was evaluated on a different held-out set "
            f"({current_tags(champion.tags).get('eval.heldout_md5')} vs {evaluation['heldout_md5']}); not comparable")}
    theirs = champion_rewards(client, champion)
    ids = [str(p["id"]) for p in predictions]
    if theirs is None or any(i not in theirs for i in ids):
        return base | {"promote": False, "reason": f"champion v{champion.version} has no per-prompt held-out rewards"}
    ours = np.array([p["candidate_reward"] for p in predictions])
    champ = np.array([theirs[i] for i in ids])
    cmp = paired_bootstrap(ours, champ, cfg.evaluate.bootstrap_samples, cfg.seed)
    wins = cmp["mean"] > 0 and cmp["ci95_low"] > cfg.register.min_ci_low
    verdict = "beats" if wins else "does not beat"
    return base | {"promote": bool(wins), "vs_champion": cmp, "reason": (
        f"{verdict} champion v{champion.version}: improvement {cmp['mean']:+.4f} "
        f"(95% CI {cmp['ci95_low']:+.4f} .. {cmp['ci95_high']:+.4f}, needs low > {cfg.register.min_ci_low})")}


def register(cfg: PipelineConfig, paths: Paths = Paths()) -> dict[str, Any]:
    name = cfg.register.model_name
    evaluation = json.loads((paths.metrics / "eval.json").read_text())
    predictions = read_jsonl(paths.eval_dir / "predictions.jsonl")
    candidate_md5 = dir_md5(paths.grpo_model)
    from components.locks import REGISTRY_LOCK, file_lock

    with file_lock(paths.root / REGISTRY_LOCK, "a registry change in this repository", wait_s=600):
        return _register_locked(cfg, paths, name, evaluation, predictions, candidate_md5)


def _register_locked(cfg: PipelineConfig, paths: Paths, name: str, evaluation: dict[str, Any],
                     predictions: list[dict[str, Any]], candidate_md5: str) -> dict[str, Any]:
    import mlflow

    from components.tracking.runs import client as mlflow_client
    from components.tracking.runs import stage_run

    client = mlflow_client()
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
            tags = lineage_tags(cfg, paths, evaluation, candidate_md5)
            run.log_artifact(paths.eval_dir / "predictions.jsonl", "eval")
            run.log_artifact(paths.metrics / "eval.json")
            log_params_file(run, paths.root / "params.yaml")
            from components.engine.modeling import load_tokenizer
            from components.engine.prompting import PromptFormatter
            from components.tracking.registered_model import log_trained_model

            formatting = PromptFormatter(cfg.prompt, load_tokenizer(paths.grpo_model)).settings()
            with mlflow.start_run(run_id=run.run_id):
                info, model_tags = log_trained_model(client, name, paths.grpo_model,
                                                     {"max_new_tokens": cfg.evaluate.max_new_tokens, **formatting},
                                                     cfg.register.merge_lora)
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
            # Only a version whose artifacts and tags are all in place is marked complete.
            client.set_model_version_tag(name, version.version, "registration", "complete")
            version = client.get_model_version(name, version.version)
        decision = decide(client, name, version.version, evaluation, predictions, cfg)
        from components.tracking.registry import alias_version, move_alias

        aliases = [("challenger", f"registered by run {run.run_id}")]
        if decision["promote"]:
            aliases.append(("champion", decision["reason"]))
        for alias, why in aliases:  # every move is recorded with who/when/why; champion keeps its history
            held = alias_version(client, name, alias)
            if held is None or str(held.version) != str(version.version):
                move_alias(client, name, alias, str(version.version), why, "register")
        for key, value in (("promotion.decision", "champion" if decision["promote"] else "challenger"),
                           ("promotion.reason", decision["reason"])):
            client.set_model_version_tag(name, version.version, key, value)
        run.set_tags({"promotion.decision": "champion" if decision["promote"] else "challenger",
                      "promotion.reason": decision["reason"], "model_version": version.version})
        client.update_model_version(name, version.version, description=version_description(evaluation, decision))
    uri = f"models:/{name}/{version.version}"
    result = {"model_name": name, "version": str(version.version), "model_uri": uri, "promoted": decision["promote"],
              "reason": decision["reason"], "champion_version": None if decision.get("champion_version") is None else str(decision["champion_version"]),
              "champion_uri": f"models:/{name}@champion", "candidate_md5": candidate_md5,
              "vs_champion": decision.get("vs_champion")}
    paths.metrics.mkdir(parents=True, exist_ok=True)
    (paths.metrics / "register.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"register: {uri} -> {'champion' if decision['promote'] else 'challenger'} ({decision['reason']})")
    return result


def main(argv: list[str] | None = None) -> int:
    return stage_main("Register the model in MLflow and gate the champion alias.", register, argv)


if __name__ == "__main__":
    sys.exit(main())
