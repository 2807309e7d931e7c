"""Stage `validate`: a Great Expectations 1.x suite per dataset, reported row by row.

Rules: required columns, string and non-blank prompts, unique ids, answers present (the reward
needs them), one answer per prompt, prompt + completion within the model's context in real tokens, and no prompt shared
between training data and held-out data (exact and after whitespace/case normalisation).
On failure every broken rule is printed with the file, the ids and rows, the result is saved to
metrics/validation.json, and the stage exits non-zero so nothing downstream runs.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.config import PipelineConfig
from components.data.model_source import context_length, load_tokenizer, resolve_model_dir
from components.data.paths import Paths
from components.data.records import REQUIRED_COLUMNS, SPLITS, file_md5, iter_jsonl, normalise_prompt, split_path
from components.engine.models.prompting import PromptFormatter, token_counts
from components.errors import StageFailed
from components.stages.cli import stage_main

MAX_IDS_SHOWN = 20
CHUNK_ROWS = 50_000


@dataclass
class Violation:
    """One failed rule in one file, with the offending ids and 1-based rows."""

    file: str
    rule: str
    expectation: str
    ids: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)

    def message(self) -> str:
        shown = ", ".join(self.ids[:MAX_IDS_SHOWN]) + (" ..." if len(self.ids) > MAX_IDS_SHOWN else "")
        rows = ", ".join(map(str, self.rows[:MAX_IDS_SHOWN])) + (" ..." if len(self.rows) > MAX_IDS_SHOWN else "")
        where = f": ids [{shown}] (rows {rows})" if self.ids else ""
        return f"{self.file}: rule '{self.rule}' failed ({self.expectation}){where}"


def _frame(records: list[dict[str, Any]], tokenizer, heldout_norm: set[str] | None, formatter,
           target: str = "answer"):
    """The dataset as a DataFrame plus the derived columns the expectations check (`target`: what SFT writes)."""
    import pandas as pd

    df = pd.DataFrame.from_records(records)
    if "prompt" in df:
        prompts = df["prompt"]
        df["_prompt_type"] = prompts.map(lambda v: type(v).__name__)
        df["_prompt_chars"] = prompts.map(lambda v: len(v.strip()) if isinstance(v, str) else 0)
        text = [formatter(r) if isinstance(r.get("prompt"), str) else "" for r in records]
        df["_prompt_tokens"] = token_counts(tokenizer, text)
        if target in df:
            answers = df[target].map(lambda v: "" if v is None else str(v))
            pairs = [p + a for p, a in zip(text, answers)]
            df["_sft_tokens"] = [n + 1 for n in token_counts(tokenizer, pairs)]  # + EOS
        if heldout_norm is not None:
            df["_prompt_norm"] = prompts.map(normalise_prompt)
    return df


def _suite(gx, name: str, columns: list[str], split: str, max_prompt_tokens: int, max_total_tokens: int,
           heldout_prompts: list[str] | None, heldout_norm: list[str] | None, sft_target: str = "answer"):
    """The expectations for one split; `meta.rule` is the human-readable rule name."""
    E = gx.expectations
    suite = gx.ExpectationSuite(name=name)
    for col in REQUIRED_COLUMNS:
        suite.add_expectation(E.ExpectColumnToExist(column=col, meta={"rule": f"required column '{col}'"}))
    if split == "sft" and sft_target != "answer":
        rule = f"sft.target_column '{sft_target}' present (SFT learns to write it)"
        suite.add_expectation(E.ExpectColumnToExist(column=sft_target, meta={"rule": rule}))
        if sft_target in columns:
            suite.add_expectation(E.ExpectColumnValuesToNotBeNull(column=sft_target, meta={"rule": rule}))
    if "id" in columns:
        suite.add_expectation(E.ExpectColumnValuesToNotBeNull(column="id", meta={"rule": "id present"}))
        suite.add_expectation(E.ExpectColumnValuesToBeUnique(column="id", meta={"rule": "unique ids"}))
        if "_id_seen_earlier" in columns:
            suite.add_expectation(E.ExpectColumnValuesToBeInSet(column="_id_seen_earlier", value_set=[False],
                                                                meta={"rule": "unique ids"}))
    if "prompt" in columns:
        suite.add_expectation(E.ExpectColumnValuesToBeInSet(column="_prompt_type", value_set=["str"],
                                                            meta={"rule": "prompt is a string"}))
        suite.add_expectation(E.ExpectColumnValuesToBeBetween(column="_prompt_chars", min_value=1,
                                                              meta={"rule": "prompt not empty or whitespace"}))
        suite.add_expectation(E.ExpectColumnValuesToBeBetween(
            column="_prompt_tokens", max_value=max_prompt_tokens,
            meta={"rule": f"prompt + completion within context ({max_prompt_tokens} prompt tokens max)"}))
        if split == "sft" and sft_target in columns:
            suite.add_expectation(E.ExpectColumnValuesToBeBetween(
                column="_sft_tokens", max_value=max_total_tokens,
                meta={"rule": f"prompt + {sft_target} within context ({max_total_tokens} tokens)"}))
        if heldout_prompts is not None:
            suite.add_expectation(E.ExpectColumnValuesToNotBeInSet(
                column="prompt", value_set=heldout_prompts, meta={"rule": "no prompt shared with held-out data"}))
            suite.add_expectation(E.ExpectColumnValuesToNotBeInSet(
                column="_prompt_norm", value_set=heldout_norm,
                meta={"rule": "no prompt shared with held-out data after whitespace/case normalisation"}))
    if "answer" in columns:
        suite.add_expectation(E.ExpectColumnValuesToNotBeNull(column="answer",
                                                              meta={"rule": "answer present (the reward needs it)"}))
    if "_answer_conflict" in columns:
        suite.add_expectation(E.ExpectColumnValuesToBeInSet(column="_answer_conflict", value_set=[False],
                                                            meta={"rule": CONFLICT_RULE}))
    return suite


CONFLICT_RULE = "one answer per prompt (the same prompt with another answer contradicts the reward)"


class RepeatedPrompts:
    """Across a whole file (chunk by chunk, 8-byte digests only): a prompt seen again with another
    answer is a conflict, naming the row it contradicts; with the same answer it is only counted."""

    def __init__(self):
        self.first: dict[int, tuple[int, int]] = {}  # prompt digest -> (answer digest, 1-based row)
        self.identical = 0

    def mark(self, df, offset: int) -> None:
        if "prompt" not in df or "answer" not in df:
            return
        conflicts, against = [], []
        for i, (prompt, answer) in enumerate(zip(df["prompt"].tolist(), df["answer"].tolist())):
            key, value = _id_key(prompt), _id_key(answer)
            seen = self.first.setdefault(key, (value, offset + i + 1))
            repeat = seen[1] != offset + i + 1
            conflicts.append(repeat and seen[0] != value)
            self.identical += repeat and seen[0] == value
            against.append(f"row {seen[1]}" if conflicts[-1] else "")
        df["_answer_conflict"] = conflicts
        df["_conflicts_with"] = against


def _run_suite(gx, split: str, df, build_suite: Callable[[list[str]], Any]):
    """One chunk through one suite, in a fresh ephemeral context (a shared one keeps every batch alive)."""
    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = {"globally": False}
    asset = ctx.data_sources.add_pandas("pipeline").add_dataframe_asset(split)
    batch = asset.add_batch_definition_whole_dataframe("all")
    definition = ctx.validation_definitions.add(gx.ValidationDefinition(name=split, data=batch,
                                                                        suite=ctx.suites.add(build_suite(list(df.columns)))))
    return definition.run(batch_parameters={"dataframe": df}, result_format="COMPLETE")


def _id_key(value: Any) -> int:
    """An 8-byte digest of an id: the running duplicate check keeps these, not the id strings."""
    return int.from_bytes(hashlib.blake2b(str(value).encode(), digest_size=8).digest(), "big")


def iter_chunks(path: Path, size: int) -> Iterator[list[dict[str, Any]]]:
    """Records in chunks of `size`: a file of any size is validated without being held in memory whole."""
    chunk: list[dict[str, Any]] = []
    for _, record in iter_jsonl(path):
        chunk.append(record)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@dataclass(frozen=True)
class SuiteContext:
    """What every split's suite reads: the tokenizer and prompt format, the token budget, the held-out prompts."""

    gx: Any
    cfg: PipelineConfig
    tokenizer: Any
    formatter: PromptFormatter
    context: int  # the model's context length in tokens
    budget: int  # tokens a completion may take (GRPO's and evaluation's, the larger)
    heldout_prompts: list[str]
    heldout_norm: list[str]


def validate(cfg: PipelineConfig, paths: Paths = Paths(), chunk_rows: int = CHUNK_ROWS) -> list[Violation]:
    """Run the suites on every split, chunk by chunk; raise `StageFailed` listing every violation."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    from transformers import AutoConfig

    tokenizer = load_tokenizer(paths.base_model, cfg.model.trust_remote_code)
    heldout_prompts = sorted({r["prompt"] for _, r in iter_jsonl(split_path(paths.data, "heldout"))
                              if isinstance(r.get("prompt"), str)})
    suite = SuiteContext(gx, cfg, tokenizer, PromptFormatter(cfg.prompt, tokenizer), context_length(
        AutoConfig.from_pretrained(str(resolve_model_dir(paths.base_model)),
                                   trust_remote_code=cfg.model.trust_remote_code)),
        max(cfg.grpo.max_completion_length, cfg.evaluate.max_new_tokens), heldout_prompts,
        sorted({normalise_prompt(p) for p in heldout_prompts}))
    sources = json.loads((paths.data / "sources.json").read_text())
    found: dict[tuple[str, str], Violation] = {}
    report: dict[str, Any] = {"success": True, "files": {}}
    total = 0
    checked: dict[str, str] = {}  # file md5 -> split already validated (SFT is often a copy of train)
    docs: dict[str, Any] = {}  # split -> GX result of its first chunk, rendered as data docs
    for split in SPLITS:
        leak_check = split != "heldout"
        file_label = str(split_path(paths.data, split))
        if not sources.get(split, "").startswith("generated:"):
            file_label = f"{sources[split]} (prepared as {file_label})"
        digest = file_md5(split_path(paths.data, split))
        own_target = split == "sft" and cfg.sft.enabled and cfg.sft.target_column != "answer"
        if leak_check and digest in checked and not own_target:
            same = checked[digest]
            report["files"][split] = {**report["files"][same], "file": file_label, "same_content_as": same}
            if same in docs:
                docs[split] = docs[same]
            total += report["files"][split]["rows"]
            for (label, rule), v in list(found.items()):
                if label == report["files"][same]["file"]:
                    found[(file_label, rule)] = Violation(file_label, rule, v.expectation, list(v.ids), list(v.rows))
            continue
        if leak_check:
            checked[digest] = split
        rows, checks = _validate_split(suite, paths, split, file_label, leak_check, chunk_rows, found, docs)
        total += rows
        # Deterministic (no GX run ids or timestamps): downstream DVC stages depend on this file.
        report["files"][split] = {"file": file_label, "rows": rows,
                                  "success": all(c["success"] for c in checks.values()),
                                  "checks": sorted(checks.values(), key=lambda c: c["rule"])}
    return _report(cfg, paths, report, list(found.values()), docs, total)


def _validate_split(suite: SuiteContext, paths: Paths, split: str, file_label: str, leak_check: bool,
                    chunk_rows: int, found: dict[tuple[str, str], Violation],
                    docs: dict[str, Any]) -> tuple[int, dict[str, dict[str, Any]]]:
    """One split's suite, chunk by chunk: (rows, each rule's check), the violations added to `found` and its first
    chunk's result to `docs`."""
    cfg = suite.cfg
    seen_ids: set[int] = set()
    repeated = RepeatedPrompts()
    checks: dict[str, dict[str, Any]] = {}
    offset = 0
    for n, chunk in enumerate(iter_chunks(split_path(paths.data, split), chunk_rows)):
        if n:  # the last chunk's frames and results (GX's hold reference cycles) freed before this one grows
            gc.collect()
        sft_target = cfg.sft.target_column if split == "sft" and cfg.sft.enabled else "answer"
        df = _frame(chunk, suite.tokenizer, set(suite.heldout_norm) if leak_check else None, suite.formatter,
                    sft_target)
        if "id" in df:  # duplicates across chunks; within a chunk GX's uniqueness check sees them
            keys = [_id_key(i) for i in df["id"]]
            df["_id_seen_earlier"] = [k in seen_ids for k in keys]
            seen_ids.update(keys)
        repeated.mark(df, offset)
        result = _run_suite(suite.gx, split, df, lambda columns, target=sft_target: _suite(
            suite.gx, f"{split}_suite", columns, split, suite.context - suite.budget, suite.context,
            suite.heldout_prompts if leak_check else None, suite.heldout_norm if leak_check else None, target))
        if n == 0:
            docs[split] = result
        _record(result, df, offset, file_label, checks, found)
        offset += len(df)
        del df, result
    if offset == 0:
        raise StageFailed(f"{file_label}: file is empty (no records)")
    if repeated.identical:
        print(f"validate: warning: {file_label}: {repeated.identical} row(s) repeat an earlier prompt with the "
              "same answer (kept; they weigh that prompt more)")
    return offset, checks


def _record(result: Any, df: Any, offset: int, file_label: str, checks: dict[str, dict[str, Any]],
            found: dict[tuple[str, str], Violation]) -> None:
    """A chunk's GX results into each rule's check and, where a rule broke, its violation (ids and rows)."""
    for res in result.results:
        idx = list((res.result or {}).get("unexpected_index_list") or [])
        ids = [str(df["id"].iloc[i]) if "id" in df else f"row {offset + i + 1}" for i in idx]
        rule = res.expectation_config.meta.get("rule", "?")
        if rule == CONFLICT_RULE:  # name both rows of each contradiction
            ids = [f"{ids[k]} contradicts {df['_conflicts_with'].iloc[i]}" for k, i in enumerate(idx)]
        check = checks.setdefault(rule, {"rule": rule, "expectation": res.expectation_config.type,
                                         "success": True, "unexpected_count": 0, "ids": []})
        check["success"] &= bool(res.success)
        check["unexpected_count"] += len(idx)
        check["ids"] = (check["ids"] + ids)[:100]
        if not res.success:
            v = found.setdefault((file_label, rule), Violation(file=file_label, rule=rule,
                                                               expectation=res.expectation_config.type))
            v.ids = (v.ids + ids)[:1000]
            v.rows = (v.rows + [offset + i + 1 for i in idx])[:1000]


def _report(cfg: PipelineConfig, paths: Paths, report: dict[str, Any], violations: list[Violation],
            docs: dict[str, Any], total: int) -> list[Violation]:
    """metrics/validation.json and the validate run in MLflow (both before failing: the report is the point of a
    failed validation); then the verdict."""
    report["success"] = not violations
    report["violations"] = [v.__dict__ | {"message": v.message()} for v in violations]
    paths.metrics.mkdir(parents=True, exist_ok=True)
    report_path = paths.metrics / "validation.json"
    report_path.write_text(json.dumps(report, indent=1, sort_keys=True, default=str) + "\n")
    from components.tracking.runs import stage_run

    with stage_run(cfg.tracking.experiment, "validate") as run:
        run.log_artifact(report_path)
        from components.tracking.reports import log_data_docs

        log_data_docs(run, docs)
        run.log_metrics({"violations": len(violations), "records": total})
        run.set_tags({"validation.success": not violations})
    if violations:
        lines = "\n".join(f"  - {v.message()}" for v in violations)
        raise StageFailed(f"validation failed, {len(violations)} rule(s) broken; nothing was trained:\n{lines}\n"
                          f"  full result: {paths.metrics / 'validation.json'}")
    print(f"validate: {total} records in {len(SPLITS)} files passed every rule")
    return violations


def main(argv: list[str] | None = None) -> int:
    return stage_main("Validate every dataset with Great Expectations.", validate, argv)


if __name__ == "__main__":
    sys.exit(main())
