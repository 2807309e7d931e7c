"""The bad-input corpus: every case is refused before any training, with the file or key, the row or
id, and the rule in one message. Cases go through the stages' own command-line entry points
(prepare -> model -> validate), exactly as `dvc repro` and the Prefect flow run them."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import committed_params

HELDOUT = [{"id": f"h{i}", "prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(1, 6)]
TRAIN = [{"id": f"t{i}", "prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(10, 20)]


def jsonl(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


def with_row(rows, index, **changes):
    rows = [dict(r) for r in rows]
    rows[index].update(changes)
    return rows

# (case id, train file name, train file bytes or text, expected fragments of the message)
DATA_CASES = [
    ("missing-prompt-column", "train.jsonl", jsonl([{k: v for k, v in r.items() if k != "prompt"} for r in TRAIN]),
     ["train.jsonl: no 'prompt' column (columns: answer, id)", "data.columns: {YOUR_COLUMN: prompt}"]),
    ("csv-prompt-column-named-question", "train.csv", "id,question,answer\nt1,1+1=,2\nt2,2+2=,4\n",
     ["train.csv: no 'prompt' column (columns: answer, id, question)", "data.columns: {question: prompt}"]),
    ("conflicting-answers", "train.jsonl", jsonl(TRAIN + [{"id": "t99", "prompt": "10+1=", "answer": "12"}]),
     ["rule 'one answer per prompt", "t99 contradicts row 1"]),
    ("missing-answer-column", "train.jsonl", jsonl([{k: v for k, v in r.items() if k != "answer"} for r in TRAIN]),
     ["train.jsonl", "rule 'required column 'answer'' failed"]),
    ("empty-prompt", "train.jsonl", jsonl(with_row(TRAIN, 2, prompt="")),
     ["train.jsonl", "rule 'prompt not empty or whitespace' failed", "ids [t12] (rows 3)"]),
    ("whitespace-prompt", "train.jsonl", jsonl(with_row(TRAIN, 4, prompt=" \t ")),
     ["rule 'prompt not empty or whitespace' failed", "ids [t14] (rows 5)"]),
    ("null-answer", "train.jsonl", jsonl(with_row(TRAIN, 1, answer=None)),
     ["rule 'answer present (the reward needs it)' failed", "ids [t11] (rows 2)"]),
    ("duplicate-ids", "train.jsonl", jsonl(with_row(TRAIN, 5, id="t10")),
     ["rule 'unique ids' failed", "ids [t10, t10] (rows 1, 6)"]),
    ("null-id", "train.jsonl", jsonl(with_row(TRAIN, 3, id=None)),
     ["rule 'id present' failed", "rows 4"]),
    ("non-string-prompt", "train.jsonl", jsonl(with_row(TRAIN, 6, prompt=123)),
     ["rule 'prompt is a string' failed", "ids [t16] (rows 7)"]),
    ("list-prompt", "train.jsonl", jsonl(with_row(TRAIN, 7, prompt=["1+1="])),
     ["rule 'prompt is a string' failed", "ids [t17]"]),
    ("malformed-jsonl-line", "train.jsonl", jsonl(TRAIN[:3]) + '{"id": "x", "prompt": \n' + jsonl(TRAIN[3:]),
     ["train.jsonl: line 4: malformed JSON"]),
    ("jsonl-line-not-object", "train.jsonl", jsonl(TRAIN[:2]) + '["a", "b"]\n',
     ["train.jsonl: line 3: expected a JSON object"]),
    ("invalid-utf8", "train.jsonl", jsonl(TRAIN[:2]).encode() + b'{"id": "bad", "prompt": "\xff\xfe"}\n',
     ["train.jsonl: line 3: invalid UTF-8"]),
    ("empty-file", "train.jsonl", "", ["train.jsonl: file is empty"]),
    ("blank-lines-only", "train.jsonl", "\n\n  \n", ["train.jsonl: file is empty"]),
    ("exact-leak", "train.jsonl", jsonl(with_row(TRAIN, 8, prompt="3+3=")),
     ["rule 'no prompt shared with held-out data' failed", "ids [t18] (rows 9)"]),
    ("normalised-leak", "train.jsonl", jsonl(with_row(TRAIN, 9, prompt="  4+4= ")),
     ["after whitespace/case normalisation' failed", "ids [t19] (rows 10)"]),
    ("prompt-too-long", "train.jsonl", jsonl(with_row(TRAIN, 0, prompt="1+" * 20 + "1=")),
     ["rule 'prompt + completion within context", "ids [t10] (rows 1)"]),
    ("csv-ragged-row", "train.csv", "id,prompt,answer\nt1,1+1=,2\nt2,2+2=,4,oops\n",
     ["train.csv: line 3: ragged row (4 fields, header has 3)"]),
    ("csv-empty-prompt", "train.csv", "id,prompt,answer\nt1,1+1=,2\nt2,,4\n",
     ["train.csv", "rule 'prompt not empty or whitespace' failed", "ids [t2] (rows 2)"]),
    ("json-not-a-list", "train.json", json.dumps({"rows": TRAIN}),
     ["train.json: expected a list of records or an object with a 'prompts' list"]),
    ("json-malformed", "train.json", '[{"id": "a",', ["train.json: line 1: malformed JSON"]),
    ("unknown-extension", "train.txt", "hello", ["train.txt: cannot tell the format from the extension '.txt'"]),
]


@pytest.fixture
def workdir(tmp_path, monkeypatch, mlflow_store):
    """A repo-like folder whose registry already has a champion that no bad input may touch."""
    from mlflow.tracking import MlflowClient

    shutil.copy(committed_params(), tmp_path / "params.yaml")
    (tmp_path / "data" / "user").mkdir(parents=True)
    (tmp_path / "data" / "user" / "heldout.jsonl").write_text(jsonl(HELDOUT))
    (tmp_path / "models" / "grpo").mkdir(parents=True)
    (tmp_path / "models" / "grpo" / "weights.bin").write_bytes(b"earlier artifact")
    client = MlflowClient(tracking_uri=mlflow_store)
    client.create_registered_model("grpo-addition")
    version = client.create_model_version("grpo-addition", "file:///earlier/model", tags={"registration": "complete"})
    client.set_registered_model_alias("grpo-addition", "champion", version.version)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    # After every case: the champion, the registry and earlier artifacts are exactly as before.
    assert str(client.get_model_version_by_alias("grpo-addition", "champion").version) == str(version.version)
    assert len(client.search_model_versions("name = 'grpo-addition'")) == 1
    assert (tmp_path / "models" / "grpo" / "weights.bin").read_bytes() == b"earlier artifact"


def run_until_validate(overrides, capsys):
    """prepare -> model -> validate through their CLIs; returns (exit code, stderr) of the first failure."""
    from components.stages import model, prepare, validate

    argv = [x for o in overrides for x in ("--set", o)]
    for stage in (prepare, model, validate):
        code = stage.main(argv)
        if code != 0:
            return code, capsys.readouterr().err
    return 0, capsys.readouterr().err


@pytest.mark.parametrize("name,filename,content,expected", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_dataset_is_refused_before_training(workdir, capsys, name, filename, content, expected):
    path = workdir / "data" / "user" / filename
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err = run_until_validate([f"data.train_path=data/user/{filename}",
                                    "data.heldout_path=data/user/heldout.jsonl"], capsys)
    assert code == 1, err
    for fragment in expected:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    assert not (workdir / "models" / "sft").exists() and not (workdir / "checkpoints").exists()


def test_missing_file_is_named(workdir, capsys):
    code, err = run_until_validate(["data.train_path=data/user/nope.jsonl"], capsys)
    assert code == 1 and "data/user/nope.jsonl: file does not exist" in err


def test_parquet_with_wrong_column_type_is_named(workdir, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"id": "a", "prompt": "1+1=", "answer": 2}]), workdir / "data/user/t.parquet")
    code, err = run_until_validate(["data.train_path=data/user/t.parquet"], capsys)
    assert code == 1 and "t.parquet: column 'answer' has type int64, expected string" in err


PARAM_CASES = [
    ("grpo.learning_rate=0", "grpo.learning_rate: must be > 0"),
    ("grpo.learning_rate=-0.001", "grpo.learning_rate: must be > 0"),
    ("sft.learning_rate=0", "sft.learning_rate: must be > 0"),
    ("grpo.group_size=1", "grpo.group_size: must be >= 2"),
    ("grpo.minibatch_size=20", "grpo.minibatch_size: must be a multiple of grpo.group_size (8)"),
    ("grpo.loss_type=ppo", "grpo.loss_type: 'ppo' is not one of"),
    ("grpo.scale_rewards=softmax", "grpo.scale_rewards: 'softmax' is not one of"),
    ("grpo.rewards=[{name: exact_matchh}]", "grpo.rewards[0].name: \"unknown reward 'exact_matchh'"),
    ("grpo.rewards=[{name: 'not_a_module_abc:fn'}]", "grpo.rewards[0].name: cannot import module 'not_a_module_abc'"),
    ("grpo.rewards=[{name: 'reward_fixtures:no_such_fn'}]", "grpo.rewards[0].name: 'reward_fixtures' has no callable"),
    ("grpo.temperature=0", "grpo.temperature: must be > 0"),
    ("grpo.kl_beta=-1", "grpo.kl_beta: must be >= 0"),
    ("model.name_or_path=/no/such/model", "model path /no/such/model does not exist"),
]


@pytest.mark.parametrize("override,message", PARAM_CASES, ids=[c[0] for c in PARAM_CASES])
def test_bad_params_are_refused_naming_the_key(workdir, capsys, override, message):
    code, err = run_until_validate([override], capsys)
    assert code == 1 and message in err, err
    assert not (workdir / "data" / "prepared").exists() or override.startswith("model.")


def test_typo_in_params_file_is_refused(workdir, capsys):
    params = workdir / "params.yaml"
    params.write_text(params.read_text().replace("  group_size: 8", "  grop_size: 8"))
    code, err = run_until_validate([], capsys)
    assert code == 1 and "grpo.grop_size: unknown key (did you mean 'grpo.group_size'?)" in err


def test_corpus_has_at_least_thirty_cases():
    assert len(DATA_CASES) + 2 + len(PARAM_CASES) + 1 >= 30
