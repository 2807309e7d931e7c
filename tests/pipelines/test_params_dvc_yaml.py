"""Tool and environment names written as the docs write them reach DVC as written: whatever a run writes into
params.yaml, DVC's YAML 1.2 parser reads back exactly as the pipeline does (values that need quotes there get them),
shown through a real `dvc repro` whose dvc.lock records the values DVC read."""

from __future__ import annotations

import shutil
import textwrap

import pytest
import yaml

from components.config.loading import load_yaml
from pipelines.params_io import BASE_FILE, check_dvc_reads, prepare_params

from conftest import BIN, committed_params, copy_tracked, run

TOOLS = ["calculator", "shopcat.catalogue:price_of"]
ENVIRONMENT = "shopcat.games:guess_the_number"

# Every way the docs write them: a --params file with flow style, one with block lists, --set.
FORMS = {
    "--params flow": ("grpo: {tools: [calculator, shopcat.catalogue:price_of]}\n", [], "tools"),
    "--params block": ("grpo:\n  tools:\n    - calculator\n    - shopcat.catalogue:price_of\n", [], "tools"),
    "--set flow list": (None, ["grpo.tools=[calculator, shopcat.catalogue:price_of]"], "tools"),
    "--params flow environment": ("grpo: {environment: shopcat.games:guess_the_number}\n", [], "environment"),
    "--set environment": (None, ["grpo.environment=shopcat.games:guess_the_number"], "environment"),
}

PACKAGE = {
    "catalogue.py": '''
        def price_of(item: str) -> str:
            """The catalogue price of an item.

            Args:
                item: the item's name.
            """
            return {"apple": "0.40"}.get(item, "unknown")
        ''',
    "games.py": '''
        class GuessTheNumber:
            def reset(self, record):
                return [{"role": "user", "content": "Guess my number (1-10)."}]

            def step(self, turn):
                return {"done": True, "reward": float(turn.strip() == "7")}


        def guess_the_number():
            return GuessTheNumber()
        ''',
}

# A stage that keys on the two params: DVC records in dvc.lock the values it read from params.yaml.
DVC_YAML = """stages:
  reads:
    cmd: python -c "from components.config import load_config; g = load_config().grpo; print(g.tools, g.environment)"
    params:
      - grpo.tools
      - grpo.environment
"""


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git + DVC repository holding the project's params.yaml and code, and the user's package `shopcat`."""
    repo = tmp_path / "repo"
    copy_tracked(repo, under="components")
    shutil.copy(committed_params(), repo / "params.yaml")
    (repo / "dvc.yaml").write_text(DVC_YAML)
    package = tmp_path / "site" / "shopcat"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name, source in PACKAGE.items():
        (package / name).write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    run(["git", "init", "-q"], repo)
    run([str(BIN / "dvc"), "init", "-q"], repo)
    return repo


def dvc_read(repo) -> dict:
    """`dvc repro`, then the grpo params DVC read from params.yaml, as dvc.lock records them."""
    out = run([str(BIN / "dvc"), "repro"], repo, check=False)
    assert out.returncode == 0, out.stdout[-3000:]
    lock = load_yaml((repo / "dvc.lock").read_text())  # as DVC reads it (YAML 1.2: `1e-05` is a float)
    return lock["stages"]["reads"]["params"]["params.yaml"]


@pytest.mark.parametrize("form", list(FORMS))
def test_every_documented_form_of_tool_and_environment_names_reaches_dvc_as_written(repo, tmp_path, form):
    overlay_text, overrides, key = FORMS[form]
    overlays = []
    if overlay_text is not None:
        overlays = [tmp_path / "mine.yaml"]
        overlays[0].write_text(overlay_text)
    # episodes need a chat-templated model (the tiny default has none); what is checked here is only what DVC reads
    prepare_params(repo, overlays, [*overrides, "model.name_or_path=models/a-chat-model"], persist=False,
                   described=form)
    written = (repo / "params.yaml").read_text()
    assert yaml.safe_load(written)["grpo"][key] == (TOOLS if key == "tools" else ENVIRONMENT)
    read = dvc_read(repo)
    assert read[f"grpo.{key}"] == (TOOLS if key == "tools" else ENVIRONMENT), written
    # and the user's own settings come back for the next plain run, DVC reading them too
    prepare_params(repo, [], [], persist=False)
    assert not (repo / BASE_FILE).exists() and dvc_read(repo)["grpo.tools"] == []


def test_a_params_yaml_dvc_would_read_otherwise_is_refused_in_one_line_naming_the_line_and_the_fix(repo):
    """Written by hand in params.yaml itself (the run does not rewrite the user's file), the flow list with a
    `module:function` is refused before anything runs, naming the line and both ways to write it."""
    from components.config import ConfigError

    params = repo / "params.yaml"
    params.write_text(params.read_text().replace("  tools: []", "  tools: [calculator, shopcat.catalogue:price_of]")
                      .replace("  name_or_path: null", "  name_or_path: models/a-chat-model"))
    line = next(i for i, text in enumerate(params.read_text().splitlines(), 1) if "shopcat.catalogue" in text)
    with pytest.raises(ConfigError) as refused:
        check_dvc_reads(params)
    assert str(refused.value).startswith(f"params.yaml: DVC reads params.yaml as YAML 1.2 and cannot read line {line} "
                                         "('tools: [calculator, shopcat.catalogue:price_of]")
    assert str(refused.value).endswith('quote a value with a \':\' inside [...] (`[calculator, "pkg.mod:fn"]`) or '
                                       "write the list one item a line (`- pkg.mod:fn`)")
    params.write_text(params.read_text().replace("shopcat.catalogue:price_of]", '"shopcat.catalogue:price_of"]'))
    check_dvc_reads(params)  # the quoted form, as the message says
    assert dvc_read(repo)["grpo.tools"] == TOOLS


RATES = {  # how users write a small learning rate: --set in either notation, a --params file, a hand edit
    "--set 0.00005": ([], ["grpo.learning_rate=0.00005"], None, 5e-05),
    "--set 1e-5": ([], ["grpo.learning_rate=1e-5"], None, 1e-05),
    "--params 2e-6": ("grpo: {learning_rate: 2e-6}\n", [], None, 2e-06),
    "hand edit 3e-7": ([], [], "  learning_rate: 3e-7", 3e-07),
}


@pytest.mark.parametrize("form", list(RATES))
def test_a_small_learning_rate_reaches_dvc_and_the_pipeline_as_the_same_number(repo, tmp_path, form):
    """YAML 1.1 (PyYAML) reads `5e-05` and `1e-5` as strings, YAML 1.2 (DVC) as floats: the pipeline reads params
    as DVC does, and writes a float so both read it as one (`5.0e-05`)."""
    from components.config import load_config

    overlay_text, overrides, edit, expected = RATES[form]
    keyed = DVC_YAML.replace("g.tools, g.environment", "g.learning_rate")
    keyed = keyed.replace("      - grpo.tools\n      - grpo.environment", "      - grpo.learning_rate")
    (repo / "dvc.yaml").write_text(keyed)
    params = repo / "params.yaml"
    if edit:
        params.write_text(params.read_text().replace("  learning_rate: 0.0005", edit, 1))
    overlays = []
    if overlay_text:
        overlays = [tmp_path / "mine.yaml"]
        overlays[0].write_text(overlay_text)
    prepare_params(repo, overlays, overrides, persist=False, described=form)
    assert load_config(params).grpo.learning_rate == expected
    assert dvc_read(repo)["grpo.learning_rate"] == expected, params.read_text()
    if overrides:  # what the run wrote is a float to a YAML 1.1 reader too (a user's script, PyYAML's safe_load)
        assert yaml.safe_load(params.read_text())["grpo"]["learning_rate"] == expected


def test_deploy_params_and_the_registered_lineage_read_small_numbers_as_numbers(tmp_path):
    """`grpo-pipeline deploy --param grpo.learning_rate=1e-5` and register's redacted `lineage/params.yaml` read
    `1e-5` as params.yaml is read (YAML 1.2: a number), not as the string YAML 1.1 makes of it; a secret-looking value
    is still redacted in the lineage copy."""
    from components.stages.register import log_params_file
    from pipelines.commands.operations import _param_overrides

    assert _param_overrides(["grpo.learning_rate=1e-5", "grpo.steps=3"]) == {"grpo.learning_rate": 1e-05,
                                                                             "grpo.steps": 3}

    class Run:  # what log_params_file asks of an MLflow run: the artifact it logs, read as logged
        logged: dict = {}

        def log_artifact(self, path, folder):
            self.logged[folder] = yaml.safe_load(open(path).read())

    params = tmp_path / "params.yaml"
    params.write_text("grpo:\n  learning_rate: 1e-5\ntracking:\n  api_token: hunter2\n")
    run = Run()
    log_params_file(run, params)
    assert run.logged["lineage"]["grpo"]["learning_rate"] == 1e-05
    assert run.logged["lineage"]["tracking"]["api_token"] != "hunter2"
