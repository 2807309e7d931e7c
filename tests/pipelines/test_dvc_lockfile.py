"""pipelines/dvc_lockfile.py: DVC's lock file written without the round trip holds what DVC's own writes hold, byte for
byte, and DVC reads it back as up to date; files other than lock files keep DVC's round trip (their comments).
Real git + DVC repositories, stages reproduced through DVC's Python API as the flow does."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import BIN, run

DVC_YAML = """\
# a user's comment, which DVC's round trip keeps
stages:
  first:
    cmd: python -c "open('one.txt', 'w').write('1')"
    deps:
      - in.txt
    params:
      - lr
      - name
    outs:
      - one.txt
  second:
    cmd: python -c "open('two.txt', 'w').write(open('one.txt').read() * 2)"
    deps:
      - one.txt
    params:
      - flags
    outs:
      - two.txt
"""
# Values whose YAML spelling matters: a float only YAML 1.2 reads from `1e-05`, strings YAML 1.1 reads as booleans.
PARAMS = "lr: 1e-05\nname: 'yes'\nflags: [on, 'off', 3]\n"


def dvc_repo(root: Path) -> Path:
    root.mkdir()
    (root / "dvc.yaml").write_text(DVC_YAML)
    (root / "params.yaml").write_text(PARAMS)
    (root / "in.txt").write_text("input\n")
    for cmd in (["git", "init", "-q"], [str(BIN / "dvc"), "init", "-q"]):
        run(cmd, root)
    return root


def reproduce(root: Path, without_round_trip: bool) -> None:
    """Each stage on its own (`dvc repro --single-item`), from the repository, as the flow's tasks run them."""
    import contextlib

    from dvc.repo import Repo

    from pipelines.dvc_lockfile import lock_files_without_round_trip

    for stage in ("first", "second"):
        with contextlib.chdir(root), Repo(str(root)) as repo, \
                lock_files_without_round_trip() if without_round_trip else contextlib.nullcontext():
            repo.reproduce(stage, single_item=True)


def lock_data(root: Path) -> str:
    from dvc.utils.serialize import load_yaml

    return json.dumps(load_yaml(root / "dvc.lock"))  # keeps the order of every mapping


def test_the_lock_file_holds_what_dvcs_round_trip_writes_and_reads_as_up_to_date(tmp_path):
    dvcs, ours = dvc_repo(tmp_path / "round_trip"), dvc_repo(tmp_path / "safe")
    reproduce(dvcs, without_round_trip=False)
    reproduce(ours, without_round_trip=True)
    assert lock_data(ours) == lock_data(dvcs)
    assert (ours / "dvc.lock").read_text() == (dvcs / "dvc.lock").read_text()
    assert (ours / "dvc.yaml").read_text() == DVC_YAML
    status = run([str(BIN / "dvc"), "status"], ours).stdout
    assert "Data and pipelines are up to date." in status, status

    # A changed parameter: the stage's entry replaced in place, the other kept, as DVC's round trip does.
    for root in (dvcs, ours):
        (root / "params.yaml").write_text(PARAMS.replace("1e-05", "2e-05"))
    reproduce(dvcs, without_round_trip=False)
    reproduce(ours, without_round_trip=True)
    assert lock_data(ours) == lock_data(dvcs) and "lr: 2e-05" in (ours / "dvc.lock").read_text()


def test_files_other_than_lock_files_keep_dvcs_round_trip(tmp_path):
    from dvc import dvcfile

    from pipelines.dvc_lockfile import lock_files_without_round_trip

    pipeline, lock = tmp_path / "dvc.yaml", tmp_path / "dvc.lock"
    pipeline.write_text(DVC_YAML)
    lock.write_text("# not DVC's\nschema: '2.0'\n")
    with lock_files_without_round_trip():
        for path in (pipeline, lock):
            with dvcfile.modify_yaml(path) as data:
                data["added"] = 1
    assert pipeline.read_text().startswith("# a user's comment") and "added: 1" in pipeline.read_text()
    assert lock.read_text() == "schema: '2.0'\nadded: 1\n"  # a lock file: DVC's data, its comments not kept
    assert dvcfile.modify_yaml.__module__ == "dvc.utils.serialize._yaml"  # put back after the block
