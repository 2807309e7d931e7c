"""Training on torch.distributed: 2 processes (gloo, CPU) give the 1-process result on the same global batch,
with DDP and with FSDP2 (sharded weights); a 2-process run killed after a checkpoint resumes with 1
process; NCCL when there are GPUs for it.

The 2-process runs are real: the stage re-launches itself under `python -m torch.distributed.run`.
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from components.config import load_config
from components.data.paths import Paths
from components.stages.grpo import train_grpo

from conftest import LEARN, ROOT, committed_params, setup_stage_inputs

# A reward a random tiny model gets right about 5/16 of the time: mixed groups from the first step.
DENSE = ["grpo.rewards=[{name: regex_format, weight: 1.0, options: {pattern: '^[0-4]', mode: search}}]"]
# The `grpo` loss (per-sequence means over a global sequence count), KL to the reference, two passes
# over two minibatches per step: every normaliser and the old log-prob cache cross ranks.
EQUIV = LEARN + DENSE + ["grpo.steps=4", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.kl_beta=0.05",
                         "grpo.loss_type=grpo", "grpo.minibatch_size=8", "grpo.num_iterations=2",
                         "grpo.checkpoint_every=2", "grpo.log_every=1"]
# DAPO dynamic sampling with refills (the kept-group count is global), the constant dr_grpo normaliser,
# batch-std advantages, and one-group minibatches: each rank sits out every other minibatch.
DYNAMIC = ["grpo.loss_type=dr_grpo", "grpo.scale_rewards=batch", "grpo.num_iterations=1", "grpo.minibatch_size=4",
           "grpo.gradient_accumulation_steps=3", "grpo.dynamic_sampling.enabled=true",
           "grpo.dynamic_sampling.fill_batch=true"]
COMPARED = ("loss", "pg_loss", "kl", "reward_mean", "advantage_mean", "entropy", "grad_norm", "completion_length",
            "kept_completions", "sampled_completions")


@pytest.fixture
def worker_env(monkeypatch):
    """torchrun workers import the reward fixtures from tests/ and this tree's components."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "tests")]))


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def steps_csv(root):
    return list(csv.DictReader((root / "plots" / "grpo_steps.csv").open()))


def weights(root):
    return load_file(root / "models" / "grpo" / "model.safetensors")


def two_roots(tmp_path, overrides):
    one, two = tmp_path / "one", tmp_path / "two"
    for root in (one, two):
        root.mkdir()
        (root / "params.yaml").write_text((committed_params()).read_text())
    setup_stage_inputs(one, overrides)
    for sub in ("data", "models"):
        shutil.copytree(one / sub, two / sub)
    return one, two


def assert_same_training(one, two, atol=5e-5):
    rows_1, rows_2 = steps_csv(one), steps_csv(two)
    assert len(rows_1) == len(rows_2) > 0
    for r1, r2 in zip(rows_1, rows_2):
        # The same completions (same reward and length), the same loss, step by step.
        for key in COMPARED:
            assert float(r2[key]) == pytest.approx(float(r1[key]), rel=1e-4, abs=1e-5), (r1["step"], key)
    a, b = weights(one), weights(two)
    start = load_file(one / "models" / "base" / "model.safetensors")
    assert a.keys() == b.keys()
    moved = max(float((a[k] - start[k]).abs().max()) for k in a)
    assert moved > 1e-3, "training did not move the weights: the comparison would prove nothing"
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < atol, f"weights differ by {worst} after {len(rows_1)} steps"


def test_grpo_two_gloo_processes_equal_one_process(tmp_path, mlflow_store, worker_env, capfd, monkeypatch):
    # Dynamic sampling across ranks (engine/grpo/batch.py per_group_round, the same code under DDP and
    # FSDP2) is checked under
    # FSDP2 below, where it also needs the throwaway-group path.
    settings = EQUIV
    one, two = two_roots(tmp_path, settings + ["distributed.per_group_sampling=true"])
    train_grpo(load_config(committed_params(), settings + ["distributed.per_group_sampling=true"]), Paths(root=one))
    launched_tmp = tmp_path / "launched-tmp"  # the temporary directory torchrun and its workers see
    launched_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(launched_tmp))
    summary = train_grpo(load_config(committed_params(), settings + ["distributed.nproc=2"]), Paths(root=two))
    assert not list(launched_tmp.glob("torchelastic_*"))  # torchrun's logs went with the launch's own folder
    out = capfd.readouterr().out
    assert "grpo: 2 processes (DDP, gloo)" in out and "--nproc_per_node=2" in out
    assert summary["steps"] == 4
    assert_same_training(one, two)
    # Rank 0 alone wrote the outputs: one checkpoint (step 2), one MLflow run per stage invocation.
    assert [p.name for p in (two / "checkpoints" / "grpo").iterdir()] == ["step-0000002"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_store)
    runs = client.search_runs([client.get_experiment_by_name("grpo-pipeline").experiment_id])
    assert sorted(r.data.tags["grpo.stage"] for r in runs) == ["grpo", "grpo", "model", "prepare"]


@pytest.mark.slow
def test_two_process_run_killed_after_checkpoint_resumes_with_one_process(tmp_path, mlflow_store, worker_env, capfd):
    # 6 steps, a checkpoint every 2: the kill lands after step 2's checkpoint with 4 steps still to run (the run
    # must not finish first); the resumed run's equality with the straight one does not depend on the length.
    overrides = LEARN + DENSE + ["grpo.steps=6", "grpo.prompts_per_step=4", "grpo.group_size=4",
                                 "grpo.kl_beta=0.05", "grpo.reference.mode=ema", "grpo.checkpoint_every=2"]
    straight, killed = two_roots(tmp_path, overrides)
    train_grpo(load_config(committed_params(), overrides + ["distributed.per_group_sampling=true"]),
               Paths(root=straight))

    cmd = [sys.executable, "-m", "components.stages.grpo"] + [x for o in overrides + ["distributed.nproc=2"]
                                                       for x in ("--set", o)]
    proc = subprocess.Popen(cmd, cwd=killed, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    ckpts = killed / "checkpoints" / "grpo"
    deadline = time.time() + 180
    while (time.time() < deadline and proc.poll() is None
           and not (ckpts.exists() and any(p.name.startswith("step-") for p in ckpts.iterdir()))):
        time.sleep(0.02)
    tree = process_tree(proc.pid)  # the stage, torchrun's agent and both workers: the whole job dies
    assert len(tree) >= 4, f"expected launcher, torchrun and 2 workers, found {tree}"
    for pid in tree:
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30
    while time.time() < deadline and not all(gone(pid) for pid in tree):
        time.sleep(0.05)
    assert all(gone(pid) for pid in tree)
    assert not (killed / "models" / "grpo").exists(), "the run finished before it could be killed"

    # One process resumes (here, in this one): the two-process run's checkpoint is all it needs.
    cfg = load_config(committed_params(), overrides + ["distributed.per_group_sampling=true"])
    capfd.readouterr()
    train_grpo(cfg, Paths(root=killed))
    out = capfd.readouterr().out
    assert "resumed from" in out and "processes (DDP" not in out
    assert len(steps_csv(killed)) == cfg.grpo.steps
    # Same global batches whatever the process count: the resumed run ends where the straight one does.
    a, b = weights(straight), weights(killed)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"NCCL with 2 processes needs 2 CUDA devices (found {torch.cuda.device_count()})")
def test_grpo_two_nccl_processes_equal_one_process(tmp_path, mlflow_store, worker_env, capfd):
    gpu = EQUIV + ["device=cuda", "model.dtype=float32"]
    one, two = two_roots(tmp_path, gpu + ["distributed.per_group_sampling=true"])
    train_grpo(load_config(committed_params(), gpu + ["distributed.per_group_sampling=true"]), Paths(root=one))
    train_grpo(load_config(committed_params(), gpu + ["distributed.nproc=2", "distributed.backend=nccl"]),
               Paths(root=two))
    assert "grpo: 2 processes (DDP, nccl)" in capfd.readouterr().out
    assert_same_training(one, two, atol=1e-4)


# fsdp2 on top of EQUIV: an EMA reference, sharded like the policy and carried in the gathered checkpoint.
FSDP_EQUIV = EQUIV + ["grpo.reference.mode=ema"]


def fsdp2_run(one, two, settings, backend_overrides, capfd):
    """1 process, then 2 FSDP2 processes, on the same global batches; returns the 2-process stdout."""
    train_grpo(load_config(committed_params(), settings + ["distributed.per_group_sampling=true"]), Paths(root=one))
    summary = train_grpo(load_config(committed_params(), settings + ["distributed.nproc=2",
                                                                       "distributed.strategy=fsdp2"]
                                     + backend_overrides), Paths(root=two))
    assert summary["steps"] == 4
    return capfd.readouterr().out


def test_grpo_two_fsdp2_gloo_processes_equal_one_process(tmp_path, mlflow_store, worker_env, capfd):
    one, two = two_roots(tmp_path, FSDP_EQUIV + ["distributed.per_group_sampling=true"])
    out = fsdp2_run(one, two, FSDP_EQUIV, [], capfd)
    assert "grpo: 2 processes (FSDP2, gloo)" in out
    assert_same_training(one, two)
    # The checkpoint was gathered from the shards into the one-process format: a plain single process
    # resumes it (weights, EMA reference, AdamW moments) and ends with the weights of the straight run.
    assert [p.name for p in (two / "checkpoints" / "grpo").iterdir()] == ["step-0000002"]
    shutil.rmtree(two / "models" / "grpo")
    train_grpo(load_config(committed_params(), FSDP_EQUIV + ["distributed.per_group_sampling=true"]),
               Paths(root=two))
    assert "grpo: resumed from" in capfd.readouterr().out
    assert_same_training(one, two)
    # And the other way: 2 FSDP2 processes shard the one-process checkpoint (optimizer state included).
    shutil.rmtree(two / "models" / "grpo")
    shutil.rmtree(two / "checkpoints" / "grpo")
    shutil.copytree(one / "checkpoints" / "grpo", two / "checkpoints" / "grpo")
    train_grpo(load_config(committed_params(), FSDP_EQUIV + ["distributed.nproc=2", "distributed.strategy=fsdp2"]),
               Paths(root=two))
    out = capfd.readouterr().out
    assert "grpo: resumed from" in out and "at step 2/4" in out and "(FSDP2, gloo)" in out
    assert_same_training(one, two)


@pytest.mark.slow
def test_grpo_fsdp2_dynamic_sampling_equals_one_process(tmp_path, mlflow_store, worker_env, capfd):
    # Refill rounds of odd sizes (a rank samples a throwaway group to keep the all-gathers in step) and
    # one-group minibatches (each rank sits out every other one with a zero-loss forward).
    settings = FSDP_EQUIV + DYNAMIC
    one, two = two_roots(tmp_path, settings + ["distributed.per_group_sampling=true"])
    assert "(FSDP2, gloo)" in fsdp2_run(one, two, settings, [], capfd)
    assert_same_training(one, two)
    refilled_groups = [(float(r["sampled_completions"]) - 16) / 4 for r in steps_csv(two)]  # 4 groups of 4 first
    assert any(k % 2 == 1 for k in refilled_groups), \
        f"no refill round with an odd group count {refilled_groups}: the throwaway-group path never ran"


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"FSDP2 over NCCL with 2 processes needs 2 CUDA devices (found {torch.cuda.device_count()})")
def test_grpo_two_fsdp2_nccl_processes_equal_one_process(tmp_path, mlflow_store, worker_env, capfd):
    gpu = FSDP_EQUIV + ["device=cuda", "model.dtype=float32"]
    one, two = two_roots(tmp_path, gpu + ["distributed.per_group_sampling=true"])
    out = fsdp2_run(one, two, gpu, ["distributed.backend=nccl"], capfd)
    assert "grpo: 2 processes (FSDP2, nccl)" in out
    assert_same_training(one, two, atol=1e-4)


@pytest.mark.parametrize("override,rule", [
    (["distributed.strategy=fsdp2"], "distributed.strategy: fsdp2 shards the model over processes"),
    (["distributed.strategy=fsdp2", "distributed.nproc=2", "grpo.lora.enabled=true"],
     "distributed.strategy: fsdp2 with LoRA is not supported"),
    (["distributed.strategy=fsdp2", "distributed.nproc=3", "grpo.prompts_per_step=4"],
     r"grpo.prompts_per_step: must be divisible by distributed.nproc \(3\)"),
    (["distributed.strategy=zero3"], "distributed.strategy: 'zero3' is not one of"),
    (["distributed.nproc=0"], "distributed.nproc: must be >= 1"),
    (["device=cpu", "distributed.backend=nccl"], "distributed.backend: nccl needs CUDA devices"),
    (["distributed.backend=mpi"], "distributed.backend: 'mpi' is not one of"),
])
def test_bad_distributed_settings_name_the_key(override, rule):
    from components.config import ConfigError

    with pytest.raises(ConfigError, match=rule):
        load_config(committed_params(), override)


@pytest.mark.slow
def test_sft_two_fsdp2_gloo_processes_equal_one_process(tmp_path, mlflow_store, worker_env, capfd):
    from components.stages.sft import train_sft

    # 50 rows in batches of 16: the last batch has 2 rows, one per rank. One epoch (4 steps) has that batch; the
    # equality does not need more. Both through the plain forward, which a sharded model always takes (one process
    # would otherwise take the prompt-once forward, whose sums round in another order).
    sft = ["task.n_sft=50", "task.n_train=40", "task.n_heldout=20", "threads=1", "sft.epochs=1", "sft.batch_size=16",
           "grpo.prefix_sharing=false"]
    one, two = two_roots(tmp_path, sft + ["sft.enabled=false"])
    a = train_sft(load_config(committed_params(), sft), Paths(root=one))
    b = train_sft(load_config(committed_params(), sft + ["distributed.nproc=2", "distributed.strategy=fsdp2"]),
                  Paths(root=two))
    assert "--nproc_per_node=2" in capfd.readouterr().out
    assert b["steps"] == a["steps"] == 4 and b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-5)
    wa, wb = (load_file(root / "models" / "sft" / "model.safetensors") for root in (one, two))
    start = load_file(one / "models" / "base" / "model.safetensors")
    assert wa.keys() == wb.keys() == start.keys()
    assert max(float((wa[k] - start[k]).abs().max()) for k in wa) > 1e-3
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 5e-5
