"""Writing a run's overrides into params.yaml: only what changed, in the file's own style."""

from __future__ import annotations

import contextlib

import pytest

from pipelines.params_io import BASE_FILE, RUN_NOTE, apply_to_params, prepare_params, user_params

from conftest import committed_params


def test_a_run_without_overrides_leaves_params_yaml_byte_identical(tmp_path):
    params = tmp_path / "params.yaml"
    original = (committed_params()).read_bytes()
    params.write_bytes(original)
    assert apply_to_params(params, [], []) is False and params.read_bytes() == original
    # An override to the value it already has changes nothing either (same nulls, same list style).
    assert apply_to_params(params, [], ["seed=1234", "grpo.kl_beta=0.04"]) is False
    assert params.read_bytes() == original


def test_an_override_changes_its_own_line_only(tmp_path):
    params = tmp_path / "params.yaml"
    original = (committed_params()).read_text()
    params.write_text(original)
    assert apply_to_params(params, [], ["seed=7"]) is True
    changed = [(a, b) for a, b in zip(original.splitlines(), params.read_text().splitlines()) if a != b]
    assert changed == [("seed: 1234", "seed: 7")] and len(params.read_text().splitlines()) == len(original.splitlines())
    assert "  train_path: null" in params.read_text()  # ruamel's default would write an empty value


def test_writing_params_yaml_leaves_other_round_trip_writers_in_the_process_as_they_were(tmp_path):
    """DVC rewrites its files with ruamel's round trip in the CLI's process: params.yaml's own way of writing nulls
    and floats must not become theirs."""
    import io

    from ruamel.yaml import YAML

    params = tmp_path / "params.yaml"
    params.write_text(committed_params().read_text())
    assert apply_to_params(params, [], ["grpo.learning_rate=5e-05", "data.train_path=x.jsonl"]) is True
    assert "  learning_rate: 5.0e-05" in params.read_text()  # params.yaml's own float style, as YAML 1.1 reads it
    theirs = io.StringIO()
    YAML().dump({"lr": 5e-05, "path": None}, theirs)
    assert theirs.getvalue() == "lr: 5e-05\npath:\n"  # ruamel's own round trip, untouched


def test_after_a_killed_override_run_the_users_own_settings_come_back_with_their_edits(tmp_path):
    """A run with one-off overrides was killed (nothing put the user's settings back); the user then edited
    params.yaml. The next run (the same command) starts from the user's own settings with that edit, says which
    edit it kept, and applies its own overrides on top; the plain run after it is the user's own again."""
    params = tmp_path / "params.yaml"
    mine = (committed_params()).read_text()
    params.write_text(mine)
    once = ["grpo.steps=40", "seed=7"]
    prepare_params(tmp_path, [], once, persist=False, described="--set grpo.steps=40 --set seed=7")
    # ... killed here; the user edits a learning rate in the file that still holds the overrides
    params.write_text(params.read_text().replace("learning_rate: 0.0005", "learning_rate: 0.0002"))
    with user_params(tmp_path) as own:  # a scratch copy, gone after the block
        assert own.read_text() == mine.replace("learning_rate: 0.0005", "learning_rate: 0.0002")
    assert not own.exists()
    said = prepare_params(tmp_path, [], once, persist=False, described="--set grpo.steps=40 --set seed=7")
    assert said[0] == ("params.yaml: back to your own settings (the previous run's one-off overrides (--set "
                       "grpo.steps=40 --set seed=7), whose run was stopped before it could put your settings back, "
                       "were still in it), keeping your edit since: grpo.learning_rate: 0.0002")
    edited = mine.replace("learning_rate: 0.0005", "learning_rate: 0.0002")
    assert (tmp_path / BASE_FILE).read_text() == edited
    assert "steps: 40" in params.read_text() and "seed: 7" in params.read_text()
    assert "learning_rate: 0.0002" in params.read_text()
    said = prepare_params(tmp_path, [], [], persist=False)
    assert params.read_text() == edited and not (tmp_path / BASE_FILE).exists()
    assert said == ["params.yaml: back to your own settings (the previous run's one-off overrides (--set "
                    "grpo.steps=40 --set seed=7), whose run was stopped before it could put your settings back, were "
                    "for that run only; --persist keeps them)"]


@pytest.mark.slow
def test_an_example_run_leaves_the_users_settings_alone(tmp_path, prefect_home):
    """Overrides are for their run: `dvc repro` reproduces that run, the next plain run goes back to the user's
    params.yaml (DVC reusing what it cached for it), and `--persist` is how an override is kept. Real DVC."""
    from conftest import BIN, FAST_PARAMS, copy_committed_project, run

    repo = copy_committed_project(tmp_path / "repo")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}", "PREFECT_HOME": prefect_home(tmp_path / "prefect")}
    cli = [str(BIN / "grpo-pipeline"), "run"]
    first = run(cli + ["--persist"] + [x for o in FAST_PARAMS for x in ("--set", o)], repo, env=env)
    assert "params.yaml updated with the run's settings for good (--persist" in first.stdout
    mine = (repo / "params.yaml").read_bytes()  # the user's settings now: the default with FAST_PARAMS
    assert not (repo / ".params.base.yaml").exists()

    example = run(cli + ["--set", "grpo.kl_beta=0.1"], repo, env=env)
    assert "params.yaml holds this run's settings, so `dvc repro` reproduces it" in example.stdout
    assert "kl_beta: 0.1" in (repo / "params.yaml").read_text()
    assert (repo / ".params.base.yaml").read_bytes() == mine
    status = run([str(BIN / "dvc"), "status"], repo, env=env)
    assert "Data and pipelines are up to date." in status.stdout  # dvc repro would reproduce the example run

    plain = run(cli, repo, env=env)
    assert "params.yaml: back to your own settings" in plain.stdout
    assert (repo / "params.yaml").read_bytes() == mine and not (repo / ".params.base.yaml").exists()
    # Going back costs no training: GRPO's result comes back from DVC's run cache like every other stage's, and
    # the checkpoints of these settings were set aside by the example run, not removed (keyed by their inputs).
    for stage in ("grpo", "evaluate"):
        assert f"Stage '{stage}' is cached - skipping run, checking out outputs" in plain.stdout
    assert "grpo: step" not in plain.stdout and "Running stage 'grpo'" not in plain.stdout
    assert "set aside checkpoint checkpoints/grpo/step-0000003 (trained from other inputs)" in example.stdout
    aside = list((repo / "checkpoints" / "grpo-other-inputs").glob("*/step-0000003/state.pt"))
    assert len(aside) == 1
    again = run(cli, repo, env=env)  # a plain run on the user's settings changes nothing
    assert (repo / "params.yaml").read_bytes() == mine and "params.yaml" not in again.stdout.split("Running stage")[0]


def test_a_refused_override_leaves_params_yaml_untouched(tmp_path):
    from components.config import ConfigError

    params = tmp_path / "params.yaml"
    original = (committed_params()).read_bytes()
    params.write_bytes(original)
    with pytest.raises(ConfigError, match="grpo.kl_beta: must be >= 0"):
        prepare_params(tmp_path, [], ["seed=7", "grpo.kl_beta=-1"], persist=False)
    assert params.read_bytes() == original and not (tmp_path / BASE_FILE).exists()


class Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs."""


@pytest.mark.parametrize("next_run", ["plain", "other overrides", "deployment"])
@pytest.mark.parametrize("killed_after", [0, 1, 2, 3], ids=lambda k: f"killed-after-{k}-writes")
def test_overrides_come_back_after_a_kill_at_any_moment_whatever_runs_next(tmp_path, monkeypatch, capsys,
                                                                           killed_after, next_run):
    """A run with one-off overrides writes the user's own (.params.base.yaml), its note, then params.yaml, each in one
    rename, so a kill can land only between them (0, 1, 2 or all 3 written; the run then never finished). Whatever
    runs next (a plain run, a run with other overrides, a deployment's run) starts from the user's own params.yaml,
    saying so in one line when the killed run's overrides were in it, and leaves no bookkeeping file behind."""
    import pipelines.params_io as params_io

    params = tmp_path / "params.yaml"
    mine = (committed_params()).read_text()
    params.write_text(mine)
    real, writes = params_io.write_text_atomic, []

    def write_or_die(path, text):
        if len(writes) == killed_after:
            raise Killed
        writes.append(path)
        real(path, text)

    monkeypatch.setattr(params_io, "write_text_atomic", write_or_die)
    with pytest.raises(Killed) if killed_after < 3 else contextlib.nullcontext():
        prepare_params(tmp_path, [], ["grpo.steps=40"], persist=False, described="--set grpo.steps=40")
    monkeypatch.setattr(params_io, "write_text_atomic", real)
    occupied = params.read_text() != mine
    assert occupied == (killed_after == 3)

    if next_run == "deployment":
        from pipelines.leftovers import recover_after_a_kill

        recover_after_a_kill(tmp_path)
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("params.yaml:")]
        assert params.read_text() == mine
    elif next_run == "plain":
        said = prepare_params(tmp_path, [], [], persist=False)
        assert params.read_text() == mine
    else:
        said = prepare_params(tmp_path, [], ["seed=7"], persist=False, described="--set seed=7")[:-1]
        assert params.read_text() == mine.replace("seed: 1234", "seed: 7")
        assert (tmp_path / BASE_FILE).read_text() == mine  # kept for the plain run after it
    back = [line for line in said if line.startswith("params.yaml: back to your own settings")]
    assert len(back) == (1 if occupied else 0), said
    if occupied:
        assert back[0] == ("params.yaml: back to your own settings (the previous run's one-off overrides (--set "
                           "grpo.steps=40), whose run was stopped before it could put your settings back, were for "
                           "that run only; --persist keeps them)")
    if next_run != "other overrides":
        assert not (tmp_path / BASE_FILE).exists() and not (tmp_path / RUN_NOTE).exists()


@pytest.mark.parametrize("damaged", ["note empty", "note cut short", "params.yaml cut short"])
def test_bookkeeping_a_kill_cut_short_is_recovered_in_one_line(tmp_path, damaged):
    """Files an older version wrote in place, cut short by a kill: the user's own comes back from .params.base.yaml,
    and params.yaml as the killed run left it is kept in logs/ (its edits cannot be told from its overrides)."""
    params = tmp_path / "params.yaml"
    mine = (committed_params()).read_text()
    params.write_text(mine)
    prepare_params(tmp_path, [], ["grpo.steps=40"], persist=False, described="--set grpo.steps=40")
    left = params.read_text()
    if damaged == "note empty":
        (tmp_path / RUN_NOTE).write_text("")
    elif damaged == "note cut short":
        (tmp_path / RUN_NOTE).write_text((tmp_path / RUN_NOTE).read_text()[:40])
    else:
        params.write_text(left[: len(left) // 2] + "\n  bad: [")
    with user_params(tmp_path) as own:
        assert own.read_text() == mine  # a dry run or the config check reads the user's own
    said = prepare_params(tmp_path, [], [], persist=False)
    what = "params.yaml" if damaged.startswith("params") else ".params.run.json"
    assert said == [f"params.yaml: back to your own settings (a kill cut the previous run's {what} short, so its "
                    "one-off overrides could not be told from your edits; params.yaml as it left it is "
                    "logs/params-left-by-a-killed-run.yaml)"]
    assert params.read_text() == mine and not (tmp_path / BASE_FILE).exists() and not (tmp_path / RUN_NOTE).exists()
    kept = (tmp_path / "logs" / "params-left-by-a-killed-run.yaml").read_text()
    assert kept == (left if damaged.startswith("note") else left[: len(left) // 2] + "\n  bad: [")


def test_a_value_dvc_reads_otherwise_is_the_users_to_keep_and_never_one_the_run_writes(tmp_path):
    """`enabled: yes` in the user's own params.yaml (PyYAML reads true, DVC's YAML 1.2 the word 'yes': DVC only hashes
    it) is left as written, by the check and by a run's overrides; DVC failing to read the file is refused."""
    from components.config import ConfigError
    from pipelines.params_io import check_dvc_reads, dvc_reading_problem

    params = tmp_path / "params.yaml"
    mine = (committed_params()).read_text().replace("  enabled: true", "  enabled: yes", 1)
    params.write_text(mine)
    check_dvc_reads(params)
    assert apply_to_params(params, [], ["seed=7"]) and "  enabled: yes" in params.read_text()
    assert dvc_reading_problem(mine) == ("DVC (YAML 1.2) reads sft.enabled as 'yes', the pipeline as True: quote the "
                                         "value, or write it as the number or word you mean")
    params.write_text(mine.replace("seed: 1234", "seed: [1, a:b]"))
    with pytest.raises(ConfigError, match=r"cannot read line \d+ \('seed: \[1, a:b\]'\) \(found unexpected ':'\)"):
        check_dvc_reads(params)
