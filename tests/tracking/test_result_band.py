"""`grpo-pipeline run` puts its result next to the band benchmarks/seed_spread.py measured, and says
plainly when it falls outside; `reproduce` knows which promise (bit-identical or the band) applies."""

import json

from components.config import default_fingerprint, load_config
from components.tracking.run_environment import differences
from pipelines.commands.run_report import band_report
from pipelines.reproduce import Comparison, ReproduceReport

from conftest import committed_params


def _spread(root, fingerprint):
    out = root / "benchmarks" / "results"
    out.mkdir(parents=True)
    summary = {"runs": 10, "warm_start": {"median": 0.47, "min": 0.42, "max": 0.55},
               "improvement": {"median": 0.38, "min": 0.30, "max": 0.45},
               "after_grpo": {"median": 0.85, "min": 0.80, "max": 0.90}}
    (out / "seed_spread.json").write_text(json.dumps({
        "machine": {"cpu": "Some CPU"}, "seeds": [1, 2], "kernels": ["default", "avx2"],
        "summary": {"all": summary}, "default_fingerprint": fingerprint}))


def _evaluation(warm, improvement):
    return {"baseline": {"mean_reward": warm}, "improvement": {"mean": improvement}}


def test_a_result_inside_the_band_says_so(tmp_path):
    cfg = load_config(committed_params(), ["seed=99"])  # another seed is still the default
    _spread(tmp_path, default_fingerprint(cfg))
    text = band_report(tmp_path, cfg, _evaluation(0.45, 0.40))
    assert "warm start 0.420 .. 0.550, improvement +0.300 .. +0.450" in text and "within the expected band" in text


def test_a_result_outside_the_band_says_so_with_the_likely_reasons(tmp_path):
    cfg = load_config(committed_params())
    _spread(tmp_path, default_fingerprint(cfg))
    text = band_report(tmp_path, cfg, _evaluation(0.14, 0.04))
    assert "OUTSIDE the expected band (warm start and improvement)" in text and "another CPU kind" in text


def test_other_params_are_not_compared_with_the_default_band(tmp_path):
    _spread(tmp_path, default_fingerprint(load_config(committed_params())))
    text = band_report(tmp_path, load_config(committed_params(), ["grpo.steps=10"]), _evaluation(0.1, 0.0))
    assert "these params differ" in text and "OUTSIDE" not in text


def test_reproduce_expects_bits_only_in_the_same_environment():
    data = Comparison("train data md5", "a", "a", True)
    weights = Comparison("model weights md5", "w1", "w2", False)
    same = ReproduceReport("m", "c", [data, weights], environment_differences=[], band=(0.8, 0.9), reward=0.85)
    assert not same.match and "MISMATCH: the environment is the same" in same.table()
    other = ReproduceReport("m", "c", [data, weights], band=(0.8, 0.9), reward=0.85,
                            environment_differences=["cpu_capability: AVX512 -> AVX2"])
    assert other.match and "REPRODUCED WITHIN THE BAND" in other.table() and "AVX512 -> AVX2" in other.table()
    outside = ReproduceReport("m", "c", [data], band=(0.8, 0.9), reward=0.5,
                              environment_differences=["threads: 2 -> 1"])
    assert not outside.match and "OUTSIDE THE BAND" in outside.table()
    unknown = ReproduceReport("m", "c", [data], band=None, reward=0.5, environment_differences=["threads: 2 -> 1"])
    assert not unknown.match and "NOT VERIFIED" in unknown.table()


def test_environment_differences_name_each_fact():
    recorded = {"env.cpu": "A", "env.threads": "2", "lineage.lock_md5": "x"}
    current = {"env.cpu": "B", "env.threads": "2", "lineage.lock_md5": "x", "env.torch": "2.13.0"}
    assert differences(recorded, current) == ["cpu: A -> B", "torch: unrecorded -> 2.13.0"]
