"""params.yaml -> typed config: overrides, and refusals that name the key."""


import pytest

from components.config import ConfigError, load_config, section_hash, to_flat_dict

from conftest import ROOT, committed_params

PARAMS = committed_params()  # the defaults as committed, whatever a run or an edit left in the working params.yaml


def test_repository_params_load_and_match_defaults_shape():
    cfg = load_config(PARAMS)
    assert cfg.grpo.group_size >= 2
    flat = to_flat_dict(cfg)
    assert flat["grpo.kl_beta"] == cfg.grpo.kl_beta
    assert flat["grpo.rewards.0.name"] == "exact_match"


def test_overrides_are_parsed_as_yaml_scalars():
    cfg = load_config(PARAMS, ["grpo.kl_beta=0.1", "sft.enabled=false", "grpo.epsilon_high=0.28",
                               "model.name_or_path=null"])
    assert cfg.grpo.kl_beta == 0.1 and cfg.sft.enabled is False and cfg.grpo.epsilon_high == 0.28
    assert cfg.model.name_or_path is None


@pytest.mark.parametrize("override,key,rule", [
    ("grpo.learning_rate=0", "grpo.learning_rate", "must be > 0"),
    ("grpo.learning_rate=-1e-4", "grpo.learning_rate", "must be > 0"),
    ("grpo.group_size=1", "grpo.group_size", "must be >= 2"),
    ("grpo.metrics_every=0", "grpo.metrics_every", "must be >= 1"),
    ("grpo.loss_type=ppo", "grpo.loss_type", "is not one of"),
    ("grpo.kl_estimator=k4", "grpo.kl_estimator", "is not one of"),
    ("grpo.max_completion_length=40", "grpo.max_completion_length", "exceed"),
    ("grpo.steps=ten", "grpo.steps", "expected an integer"),
    ("model.tiny.num_heads=3", "model.tiny.num_heads", "must divide"),
    ("grpo.lora.quantize_base=nf4", "grpo.lora.quantize_base", "set grpo.lora.enabled true"),
    ("grpo.lora.quantize_base=int3", "grpo.lora.quantize_base", "is not one of"),
])
def test_bad_values_name_the_key_and_rule(override, key, rule):
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, [override])
    assert str(err.value).startswith(key + ":")
    assert rule in str(err.value)


@pytest.mark.parametrize("override,rule", [
    ("grpo.rewards=[{name: no_such_reward}]", "unknown reward"),
    ("grpo.rewards=[{name: 'no_such_module_xyz:f'}]", "cannot import module"),
])
def test_rewards_that_do_not_resolve_are_refused_before_a_run(override, rule):
    from pipelines.params_io import merged_config

    load_config(PARAMS, [override])  # structurally fine: resolving imports the user's code, a later check
    with pytest.raises(ConfigError) as err:
        merged_config(PARAMS, [], [override])
    assert str(err.value).startswith("grpo.rewards[0].name:") and rule in str(err.value)


def test_unknown_key_is_refused_with_a_suggestion(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text(PARAMS.read_text().replace("  kl_beta:", "  kl_betta:"))
    with pytest.raises(ConfigError, match=r"grpo\.kl_betta: unknown key \(did you mean 'grpo\.kl_beta'\?\)"):
        load_config(bad)


def test_missing_params_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_section_hash_changes_with_content():
    a, b = load_config(PARAMS), load_config(PARAMS, ["grpo.kl_beta=0.5"])
    assert section_hash(a.grpo) != section_hash(b.grpo)
    assert section_hash(a.grpo) == section_hash(load_config(PARAMS).grpo)


@pytest.mark.parametrize("example", sorted((ROOT / "configs" / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_example_configs_are_valid(example):
    from pipelines.params_io import merged_config

    cfg = merged_config(PARAMS, [example], ["model.name_or_path=/models/some-instruct-model"])
    # an instruct model reads its chat template; a base model (Gemma 3 270M) the plain text
    assert cfg.grpo.lora.enabled and cfg.prompt.chat_template == ("never" if "gemma3" in example.stem else "always")


@pytest.mark.parametrize("preset", sorted((ROOT / "configs" / "presets").glob("*.yaml")), ids=lambda p: p.stem)
def test_presets_are_valid(preset):
    from pipelines.params_io import merged_config

    assert merged_config(PARAMS, [preset], []).grpo.steps >= 1


@pytest.mark.parametrize("name,secret", [
    ("MLFLOW_TRACKING_TOKEN", True), ("HF_TOKEN", True), ("grpo.rewards.0.options.api_token", True),
    ("AWS_SECRET_ACCESS_KEY", True), ("AWS_ACCESS_KEY_ID", True), ("db.password", True), ("openaiApiKey", True),
    ("evaluate.max_new_tokens", False), ("grpo.max_completion_length", False), ("tokenizer.path", False),
    ("grpo.kl_beta", False),
])
def test_secret_names_are_recognised_without_catching_token_counts(name, secret):
    from components.tracking.runs import is_secret_key

    assert is_secret_key(name) is secret


def test_the_smoke_preset_never_registers_under_the_production_name():
    from pipelines.params_io import merged_config

    production = merged_config(PARAMS, [], []).register.model_name
    smoke = merged_config(PARAMS, [ROOT / "configs" / "presets" / "fast_test.yaml"], []).register.model_name
    assert smoke != production and smoke.startswith(production)


def test_the_defaults_params_yaml_and_the_default_preset_are_one_configuration():
    """components/config/'s defaults, the committed params.yaml and configs/presets/default.yaml agree key for
    key, so `--preset default` restores every key an example changed."""
    from dataclasses import asdict

    from components.config import PipelineConfig, read_params
    from pipelines.params_io import merged_config

    defaults = asdict(PipelineConfig())
    assert asdict(load_config(PARAMS)) == defaults
    preset = ROOT / "configs" / "presets" / "default.yaml"
    assert asdict(load_config(preset)) == defaults and set(read_params(preset)) == set(read_params(PARAMS))
    for example in sorted((ROOT / "configs" / "examples").glob("smollm2_*.yaml")):
        assert asdict(merged_config(PARAMS, [example, preset], [])) == defaults, example.name


def test_the_default_is_the_configuration_the_band_was_measured_on():
    """`make run` compares itself with the band benchmarks/seed_spread.py measured only when its fingerprint is the
    recorded one: a change to what the default trains (or a new key that changes it) must re-measure the band or
    say here why it does not change the result. Monitors, the seed and reporting keys are not in it."""
    import json

    from components.config import default_fingerprint

    recorded = json.loads((ROOT / "benchmarks" / "results" / "seed_spread.json").read_text())["default_fingerprint"]
    assert default_fingerprint(load_config(PARAMS)) == recorded
    assert default_fingerprint(load_config(PARAMS, ["seed=7", "evaluate.every=0", "monitors.window=10"])) == recorded
    assert default_fingerprint(load_config(PARAMS, ["grpo.kl_beta=0.1"])) != recorded


def test_params_files_read_on_libyaml_give_what_pyyamls_own_parser_gives():
    """ParamsLoader parses with libyaml (PyYAML's wheels ship it): every params file of the project, and the values
    whose spelling matters, read as PyYAML's pure-Python parser with the same resolvers reads them."""
    import datetime

    import yaml

    from components.config.loading import ParamsLoader, load_yaml

    # libyaml where PyYAML was built with it (its wheels are), PyYAML's own parser where not
    assert issubclass(ParamsLoader, yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader)

    class PureParamsLoader(yaml.SafeLoader):
        yaml_implicit_resolvers = ParamsLoader.yaml_implicit_resolvers  # the same resolvers, YAML 1.2's floats too

    texts = [committed_params().read_text(), "lr: 1e-5\nflag: yes\nname: 'on'\nnone: null\nwhen: 2026-12-05\n"]
    texts += [p.read_text() for p in sorted((ROOT / "configs").rglob("*.yaml"))]
    for text in texts:
        assert load_yaml(text) == yaml.load(text, Loader=PureParamsLoader)
    assert load_yaml(texts[1]) == {"lr": 1e-05, "flag": True, "name": "on", "none": None,
                                   "when": datetime.date(2026, 12, 5)}
