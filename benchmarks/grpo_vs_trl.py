"""GRPO speed and learning, side by side in one run: this project's engine vs TRL's GRPOTrainer.

Both engines train the same warm-started model (same tokenizer, task, prompts per step, group size,
completion length, temperature, learning rate, beta and loss type) for the same number of steps. Each
runs in its own process; the controller lets them take turns in short rounds (A B, B A, ...) because
these machines are shared and noisy, and reports the median of the per-round completions/s ratios.
Held-out reward (greedy, >= 1000 prompts, the same evaluator for both) is measured between rounds,
off the clock. TRL runs at its fastest honest CPU settings (use_cpu, no bf16, no gradient
checkpointing; ../shared/STACK.md). Then measures the default pipeline's orchestration overhead: the
median of three `make run`s, each in a fresh clone (`--pipeline-runs`, `--no-pipeline`; see
benchmarks/pipeline_overhead.py).

    pip install -c constraints.txt -e ".[bench]"            # TRL: a benchmark extra, never a runtime dependency
    python benchmarks/grpo_vs_trl.py                          # tiny + ~25M Llama + overhead, about 20 minutes on 2 cores
                                                              # (5 more the first time: the 25M warm start)
    python benchmarks/grpo_vs_trl.py --sizes tiny --rounds 4  # a quick look

Writes benchmarks/results/grpo_vs_trl.{json,md} and logs them to MLflow (experiment grpo-benchmarks).
Not a test: it reports figures, it does not assert them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES: dict[str, dict[str, Any]] = {
    # The pipeline's embedded default model and its SFT warm start.
    "tiny": {"model": {}, "sft": {}, "grpo": {}},
    # ~25M parameters, random init, same character tokenizer: matrix work dominates. Its warm start
    # answers 56% of the held-out prompts (at the SFT rate of 1e-3 used before: 1-3%). The tiny model's
    # GRPO rate of 5e-4 wrecks it within 8 steps (held-out 3%); at 2e-5 it learns (measured, ours:
    # 0.556 -> 0.580 after 48 steps, 1e-4 -> 0.150, 5e-5 -> 0.403). Both engines get the same rate.
    "medium": {"model": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1408,
                         "max_position_embeddings": 32},
               "sft": {"epochs": 15, "learning_rate": 3e-4, "stop_at_reward": "null"}, "grpo": {"learning_rate": 2e-5}},
}
# Hyper-parameters both engines share (TRL names in trl_config below).
SHARED = {"prompts_per_step": 16, "group_size": 8, "max_completion_length": 6, "temperature": 1.0, "top_p": 1.0,
          "learning_rate": 5e-4, "kl_beta": 0.04, "loss_type": "dapo", "scale_rewards": "group", "epsilon": 0.2,
          "max_grad_norm": 1.0, "weight_decay": 0.0,
          "warmup_steps": 10, "min_lr_ratio": 0.1}  # the pipeline's schedule: linear warm-up, cosine to 10% of the peak
PER_STEP = SHARED["prompts_per_step"] * SHARED["group_size"]  # completions per step


def hyperparameters(size: str) -> dict[str, Any]:
    """What both engines train one size with: SHARED, with that size's own values (its learning rate)."""
    return {**SHARED, **SIZES[size]["grpo"]}


ENGINES = ("ours", "trl")


# ---------------------------------------------------------------------------------------------- set-up
def size_overrides(size: str) -> list[str]:
    spec = SIZES[size]
    return ([f"model.tiny.{k}={v}" for k, v in spec["model"].items()]
            + [f"sft.{k}={v}" for k, v in spec["sft"].items()])


def prepare_start(size: str, work: Path, threads: int) -> Path:
    """Data, tokenizer, model and SFT warm start for one size, built once and reused (off the clock)."""
    from components.config import load_config
    from components.data.paths import Paths
    from components.stages.model import build_base_model
    from components.stages.prepare import prepare
    from components.stages.sft import train_sft

    root = work / size
    stamp = root / "setup.json"
    overrides = size_overrides(size) + [f"threads={threads}"]
    if stamp.exists() and json.loads(stamp.read_text()).get("overrides") == overrides:
        return root
    cfg = load_config(ROOT / "params.yaml", overrides)
    paths = Paths(root=root)
    t0 = time.perf_counter()
    prepare(cfg, paths)
    build_base_model(cfg, paths)
    train_sft(cfg, paths)
    stamp.write_text(json.dumps({"overrides": overrides, "seconds": round(time.perf_counter() - t0, 1)}))
    return root


def grpo_run_dir(root: Path, name: str) -> Path:
    """A grpo stage folder of its own that reads the shared warm start and data (symlinks, no copies)."""
    run_dir = root / name
    (run_dir / "models").mkdir(parents=True, exist_ok=True)
    (run_dir / "data").mkdir(exist_ok=True)
    for link, target in ((run_dir / "models" / "sft", root / "models" / "sft"),
                         (run_dir / "data" / "prepared", root / "data" / "prepared")):
        if link.is_symlink() and link.readlink() != target:  # left by a work folder that was moved
            link.unlink()
        if not link.exists():
            link.symlink_to(target)
    return run_dir


# ------------------------------------------------------------------------------------------ the worker
class Channel:
    """The worker's end of its two pipes to the controller (commands in, JSON reports out)."""

    def __init__(self, fd_in: int, fd_out: int):
        self._in, self._out = os.fdopen(fd_in, "r"), os.fdopen(fd_out, "w")

    def send(self, message: dict[str, Any]) -> None:
        self._out.write(json.dumps(message) + "\n")
        self._out.flush()

    def receive(self) -> str:
        return self._in.readline().strip()


class Gate:
    """Runs inside a worker: times each step, and between rounds hands control back to the controller.

    A step's time runs from the end of the previous step's hand-back to the end of this step, so it
    covers everything the engine does per step (data, logging, optimizer); evaluation and waiting
    happen while the clock is stopped.
    """

    def __init__(self, channel: "Channel", round_steps: int, evaluate):
        self.channel, self.round_steps, self.evaluate = channel, round_steps, evaluate
        self.send = channel.send
        self.steps: list[dict[str, float]] = []
        self.resumed = time.perf_counter()

    def wait(self, model) -> None:
        while True:
            command = self.channel.receive()
            if command == "eval":
                self.send({"event": "eval", **self.evaluate(model)})
            elif command in ("go", ""):
                return

    def on_step(self, step: int, model, parts: dict[str, float]) -> None:
        self.steps.append({"seconds": time.perf_counter() - self.resumed, **parts})
        if step % self.round_steps == 0:
            self.send({"event": "round", "step": step, "steps": self.steps,
                       "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
            self.steps = []
            self.wait(model)
        self.resumed = time.perf_counter()


def heldout_evaluator(cfg, root: Path, tokenizer, limit: int):
    """Greedy held-out reward of an in-memory model with the pipeline's own evaluator and rewards."""
    import torch

    from components.data.records import read_jsonl, split_path
    from components.engine.heldout import greedy_completions_of, score
    from components.engine.prompting import PromptFormatter
    from components.engine.rewards import RewardModel

    records = read_jsonl(split_path(root / "data" / "prepared", "heldout"))[:limit]
    rewards = RewardModel(cfg.grpo.rewards)
    formatter = PromptFormatter(cfg.prompt, tokenizer)

    def evaluate(model) -> dict[str, Any]:
        was_training = model.training
        model.eval()
        state = torch.get_rng_state()
        completions = greedy_completions_of(model, tokenizer, formatter, records, cfg.evaluate.max_new_tokens,
                                            cfg.evaluate.batch_size)
        torch.set_rng_state(state)  # evaluation never shifts the engine's own random stream
        model.train(was_training)
        per_prompt = score(records, completions, rewards)
        return {"mean": sum(per_prompt) / len(per_prompt), "rewards": per_prompt}

    return evaluate


def worker_config(spec: dict[str, Any]):
    from components.config import load_config

    s = hyperparameters(spec["size"])
    return load_config(ROOT / "params.yaml", size_overrides(spec["size"]) + [
        f"threads={spec['threads']}", f"seed={spec['seed']}", f"grpo.steps={spec['steps']}",
        f"grpo.prompts_per_step={s['prompts_per_step']}", f"grpo.group_size={s['group_size']}",
        f"grpo.max_completion_length={s['max_completion_length']}", f"grpo.temperature={s['temperature']}",
        f"grpo.top_p={s['top_p']}", f"grpo.learning_rate={s['learning_rate']}", f"grpo.kl_beta={s['kl_beta']}",
        f"grpo.loss_type={s['loss_type']}", f"grpo.scale_rewards={s['scale_rewards']}",
        f"grpo.epsilon={s['epsilon']}", f"grpo.max_grad_norm={s['max_grad_norm']}",
        f"grpo.weight_decay={s['weight_decay']}", f"grpo.warmup_steps={s['warmup_steps']}",
        f"grpo.min_lr_ratio={s['min_lr_ratio']}",
        "grpo.checkpoint_every=0", f"grpo.log_every={spec['steps']}", *spec.get("ours_overrides", [])])


def run_ours(spec: dict[str, Any], channel: Channel) -> None:
    from components.data.paths import Paths
    from components.engine.modeling import load_tokenizer
    from components.stages.grpo import train_grpo

    cfg = worker_config(spec)
    root = Path(spec["root"])
    mine = grpo_run_dir(root, "ours")
    gate = Gate(channel, spec["round_steps"], heldout_evaluator(cfg, root, load_tokenizer(root / "models" / "sft"),
                                                                 spec["heldout"]))

    def on_step(step: int, model, metrics: dict[str, float]) -> None:
        gate.on_step(step, model, {
            "completions": metrics["sampled_completions"],
            "tokens": metrics["completion_length"] * metrics["kept_completions"],
            "generation": metrics["time/generation"], "reward": metrics["time/reward"],
            "reference": metrics["time/reference"], "policy": metrics["time/policy"],
            "reward_mean": metrics["reward_mean"]})

    train_grpo(cfg, Paths(root=mine), callbacks=[on_step])


def run_trl(spec: dict[str, Any], channel: Channel) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from components.data.records import read_jsonl, split_path
    from components.engine.modeling import load_model, load_tokenizer
    from components.engine.rewards import RewardModel

    cfg = worker_config(spec)
    root = Path(spec["root"])
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)  # no deterministic-kernel switch: TRL at its fastest
    tokenizer = load_tokenizer(root / "models" / "sft")
    model = load_model(root / "models" / "sft", torch.device("cpu")).train()
    records = read_jsonl(split_path(root / "data" / "prepared", "train"))
    dataset = Dataset.from_list([{k: v for k, v in r.items() if k != "id"} for r in records])
    rewards = RewardModel(cfg.grpo.rewards)

    def exact_match(prompts, completions, **columns):  # the same reward code our engine calls
        return rewards(list(prompts), list(completions), {k: list(v) for k, v in columns.items()
                                                          if isinstance(v, list)}).total

    exact_match.__name__ = "exact_match"
    s = hyperparameters(spec["size"])
    args = GRPOConfig(
        output_dir=str(root / "trl-out"), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=s["prompts_per_step"] * s["group_size"], num_generations=s["group_size"],
        max_completion_length=s["max_completion_length"], temperature=s["temperature"], top_p=s["top_p"], top_k=0,
        beta=s["kl_beta"], learning_rate=s["learning_rate"], lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": s["min_lr_ratio"]}, warmup_steps=s["warmup_steps"],
        loss_type=s["loss_type"], scale_rewards=s["scale_rewards"], epsilon=s["epsilon"],
        max_grad_norm=s["max_grad_norm"], weight_decay=s["weight_decay"], num_iterations=1,
        use_bias_correction_kl=False,  # our KL term is plain k3, as in DeepSeekMath
        max_steps=spec["steps"], seed=cfg.seed, report_to="none", save_strategy="no", logging_steps=10,
        disable_tqdm=True, dataloader_num_workers=0)
    gate = Gate(channel, spec["round_steps"], heldout_evaluator(cfg, root, tokenizer, spec["heldout"]))
    timers = {"generation": 0.0, "reward": 0.0, "reference": 0.0}

    def timed(name: str, fn, only_without_grad: bool = False):
        def wrapper(*a, **kw):
            if only_without_grad and torch.is_grad_enabled():
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timers[name] += time.perf_counter() - t0
        return wrapper

    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer._generate = timed("generation", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    # With num_iterations = 1 the only no-grad log-prob forward is the reference model's.
    trainer._get_per_token_logps_and_entropies = timed("reference", trainer._get_per_token_logps_and_entropies,
                                                       only_without_grad=True)

    class Hand(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            metrics = trainer._metrics["train"]
            length = metrics["completions/mean_length"][-1] if metrics.get("completions/mean_length") else 0.0
            total = time.perf_counter() - gate.resumed
            parts = dict(timers)
            parts["policy"] = max(0.0, total - sum(parts.values()))
            reward_mean = metrics["reward"][-1] if metrics.get("reward") else 0.0
            gate.on_step(state.global_step, trainer.model, {
                "completions": float(args.per_device_train_batch_size),
                "tokens": length * args.per_device_train_batch_size, **parts, "reward_mean": reward_mean})
            for key in timers:
                timers[key] = 0.0

    trainer.add_callback(Hand())
    trainer.train()


def worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{Path(spec['root']) / 'mlflow.db'}"
    channel = Channel(spec["fd_in"], spec["fd_out"])
    {"ours": run_ours, "trl": run_trl}[spec["engine"]](spec, channel)
    channel.send({"event": "finished", "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    return 0


# -------------------------------------------------------------------------------------- the controller
class Worker:
    """One engine's process, driven over two pipes (commands in, JSON reports out)."""

    def __init__(self, engine: str, spec: dict[str, Any], log: Path):
        cmd_r, self._cmd_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.log = log.open("w")
        spec = {**spec, "engine": engine, "fd_in": cmd_r, "fd_out": rep_w}
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, pass_fds=(cmd_r, rep_w), cwd=str(ROOT))
        os.close(cmd_r)
        os.close(rep_w)
        self.commands = os.fdopen(self._cmd_w, "w")
        self.reports = os.fdopen(self._rep_r, "r")
        self.engine, self.log_path = engine, log

    def expect(self, event: str) -> dict[str, Any]:
        line = self.reports.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"{self.engine} worker exited ({self.proc.returncode}); see {self.log_path}")
        message = json.loads(line)
        if message.get("event") != event:
            raise RuntimeError(f"{self.engine}: expected {event}, got {message.get('event')}")
        return message

    def command(self, text: str) -> None:
        self.commands.write(text + "\n")
        self.commands.flush()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def warm_start_heldout(spec: dict[str, Any]) -> float:
    """The held-out reward both engines start from (greedy decoding: one evaluation serves both)."""
    import torch

    from components.engine.modeling import load_model, load_tokenizer

    root = Path(spec["root"])
    torch.set_num_threads(spec["threads"])
    evaluate = heldout_evaluator(worker_config(spec), root, load_tokenizer(root / "models" / "sft"), spec["heldout"])
    return round(evaluate(load_model(root / "models" / "sft", torch.device("cpu")))["mean"], 4)


def compare_size(size: str, args, work: Path) -> dict[str, Any]:
    import numpy as np

    from components.engine.heldout import paired_bootstrap

    root = prepare_start(size, work, args.threads)
    rounds = args.rounds if size == "tiny" else args.medium_rounds
    round_steps = args.round_steps if size == "tiny" else args.medium_round_steps
    spec = {"size": size, "root": str(root), "steps": rounds * round_steps, "round_steps": round_steps,
            "threads": args.threads, "seed": args.seed, "heldout": args.heldout}
    warm_start = warm_start_heldout(spec)
    print(f"[{size}] held-out reward of the warm start both engines begin from: {warm_start:.3f}", flush=True)
    # Started one at a time, so one engine's start-up never overlaps the other's timed steps.
    workers: dict[str, Worker] = {}
    steps: dict[str, list[dict[str, float]]] = {e: [] for e in ENGINES}
    round_rates: dict[str, list[float]] = {e: [] for e in ENGINES}
    curve: dict[str, list[dict[str, float]]] = {e: [] for e in ENGINES}
    clock = {e: 0.0 for e in ENGINES}
    final_eval: dict[str, dict[str, Any]] = {}
    peak = {e: 0.0 for e in ENGINES}
    for r in range(rounds):
        order = ENGINES if r % 2 == 0 else tuple(reversed(ENGINES))
        for engine in order:
            if engine not in workers:
                workers[engine] = Worker(engine, spec, work / f"{size}-{engine}.log")
            else:
                workers[engine].command("go")
            w = workers[engine]
            report = w.expect("round")
            clock[engine] += sum(s["seconds"] for s in report["steps"][1:])  # step 1 includes start-up
            if r > 0:  # the first round warms both engines up; timings come from the others
                steps[engine] += report["steps"]
                round_rates[engine].append(sum(s["completions"] for s in report["steps"])
                                           / sum(s["seconds"] for s in report["steps"]))
            peak[engine] = max(peak[engine], report["peak_rss_mb"])
            if args.eval_every_round or r == rounds - 1:
                w.command("eval")
                result = w.expect("eval")
                curve[engine].append({"completions": (r + 1) * round_steps * PER_STEP,
                                      "train_seconds": round(clock[engine], 2), "heldout": round(result["mean"], 4)})
                if r == rounds - 1:
                    final_eval[engine] = result
        speed = ("warm-up round" if r == 0 else
                 f"ours {round_rates['ours'][-1]:.0f} completions/s, TRL {round_rates['trl'][-1]:.0f} completions/s, "
                 f"ratio {round_rates['ours'][-1] / round_rates['trl'][-1]:.2f}")
        print(f"[{size}] round {r + 1}/{rounds}: {speed}"
              + (f"; held-out ours {curve['ours'][-1]['heldout']:.3f} TRL {curve['trl'][-1]['heldout']:.3f}"
                 if curve["ours"] and curve["ours"][-1]["completions"] == (r + 1) * round_steps * PER_STEP else ""),
              flush=True)
    for engine, w in workers.items():
        w.command("go")
        peak[engine] = max(peak[engine], w.expect("finished")["peak_rss_mb"])
        w.proc.wait(timeout=120)

    def summary(engine: str) -> dict[str, Any]:
        rows = steps[engine]
        total = sum(s["seconds"] for s in rows)
        shares = {k: round(sum(s[k] for s in rows) / total, 3) for k in ("generation", "reward", "reference", "policy")}
        return {"completions_per_s": round(statistics.median(round_rates[engine]), 1),
                "generated_tokens_per_s": round(sum(s["tokens"] for s in rows) / total, 1),
                "step_seconds_median": round(statistics.median(s["seconds"] for s in rows), 4),
                "step_seconds_p90": round(percentile([s["seconds"] for s in rows], 0.9), 4),
                "time_share": shares, "peak_rss_mb": round(peak[engine], 1),
                "heldout_reward": round(final_eval[engine]["mean"], 4), "heldout_curve": curve[engine],
                "train_seconds": round(clock[engine], 1)}

    result = {e: summary(e) for e in ENGINES}
    ratios = [o / t for o, t in zip(round_rates["ours"], round_rates["trl"])]
    diff = paired_bootstrap(np.array(final_eval["ours"]["rewards"]), np.array(final_eval["trl"]["rewards"]),
                            10_000, args.seed)
    trl_final = result["trl"]["heldout_reward"]
    reached = next((p for p in curve["ours"] if p["heldout"] >= trl_final), None)
    import torch

    from components.engine.modeling import count_parameters, load_model

    params = count_parameters(load_model(root / "models" / "sft", torch.device("cpu")))
    return {"size": size, "parameters": params, "rounds": rounds, "round_steps": round_steps,
            "steps": spec["steps"], "completions_each": spec["steps"] * PER_STEP,
            "learning_rate": hyperparameters(size)["learning_rate"], "heldout_warm_start": warm_start,
            "speedup_vs_trl": round(statistics.median(ratios), 3),
            "per_round_ratios": [round(x, 3) for x in ratios],
            "heldout_n": len(final_eval["ours"]["rewards"]),
            "heldout_ours_minus_trl": {k: round(v, 4) for k, v in diff.items()},
            "time_to_trl_final_heldout": None if reached is None else {
                "ours_train_seconds": reached["train_seconds"], "trl_train_seconds": result["trl"]["train_seconds"],
                "fraction": round(reached["train_seconds"] / result["trl"]["train_seconds"], 3)},
            "engines": result}


# --------------------------------------------------------------------------------------------- report
def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GRPO: this engine vs TRL {report['trl_version']} (same model, data and hyper-parameters)", "",
             f"Machine: {report['machine']}; {report['threads']} torch threads; command: `{report['command']}`", ""]
    for r in report["sizes"]:
        o, t = r["engines"]["ours"], r["engines"]["trl"]
        lines += [f"## {r['size']} ({r['parameters'] / 1e6:.2f}M parameters), {r['steps']} steps each "
                  f"({r['completions_each']:,} completions), {r['rounds']} alternating rounds", "",
                  f"**speedup_vs_trl (median of per-round completions/s ratios): {r['speedup_vs_trl']:.2f}x** "
                  f"(rounds: {', '.join(f'{x:.2f}' for x in r['per_round_ratios'])})", "",
                  "| | ours | TRL |", "|---|---|---|"]
        rows = [("completions/s (median of rounds)", "completions_per_s", "{:.0f}"),
                ("generated tokens/s", "generated_tokens_per_s", "{:.0f}"),
                ("s/step median", "step_seconds_median", "{:.4f}"), ("s/step p90", "step_seconds_p90", "{:.4f}"),
                ("peak RSS (MB)", "peak_rss_mb", "{:.0f}"), ("training seconds", "train_seconds", "{:.1f}"),
                (f"held-out reward (n={r['heldout_n']})", "heldout_reward", "{:.3f}")]
        for label, key, fmt in rows:
            lines.append(f"| {label} | {fmt.format(o[key])} | {fmt.format(t[key])} |")
        for part in ("generation", "reward", "reference", "policy"):
            lines.append(f"| share: {part} | {o['time_share'][part]:.0%} | {t['time_share'][part]:.0%} |")
        d = r["heldout_ours_minus_trl"]
        lines += ["", f"Both start from the same warm start (held-out {r['heldout_warm_start']:.3f}); GRPO learning "
                  f"rate {r['learning_rate']:g} for both.", "",
                  f"Held-out ours - TRL: {d['mean']:+.3f} (95% CI {d['ci95_low']:+.3f} .. {d['ci95_high']:+.3f}).",
                  ""]
        reach = r["time_to_trl_final_heldout"]
        if reach:
            lines += [f"TRL's final held-out reward was reached by ours after {reach['ours_train_seconds']:.1f} s of "
                      f"training, {reach['fraction']:.1%} of TRL's {reach['trl_train_seconds']:.1f} s.", ""]
        curve = " | ".join(f"{p['completions']:,}: {p['heldout']:.3f} @ {p['train_seconds']:.0f}s" for p in o["heldout_curve"])
        lines += [f"Held-out curve, ours (completions: reward @ training seconds): {curve}", ""]
        curve = " | ".join(f"{p['completions']:,}: {p['heldout']:.3f} @ {p['train_seconds']:.0f}s" for p in t["heldout_curve"])
        lines += [f"Held-out curve, TRL: {curve}", ""]
    if report.get("pipeline_overhead"):
        p = report["pipeline_overhead"]
        lines += ["## Orchestration overhead of the default pipeline (`make run`, fresh clone)", "",
                  f"{p['statistic'].capitalize()}: wall {p['wall_seconds']:.1f} s, stages' own compute "
                  f"{p['compute_seconds']:.1f} s: overhead (Prefect, MLflow, DVC, start-up, imports) "
                  f"{p['overhead_seconds']:.1f} s = **{p['overhead_share']:.1%}**. Held-out {p['heldout_before']:.3f} -> "
                  f"{p['heldout_after']:.3f}.", ""]
        if len(p["runs"]) > 1:
            lines += ["Each run: " + " | ".join(f"{r['overhead_seconds']:.1f} s of {r['wall_seconds']:.1f} s = "
                                                f"{r['overhead_share']:.1%}" for r in p["runs"]), ""]
    gpu = report.get("gpu")
    lines += ["## GPU", "", (f"{gpu['device']}: ~0.5B Qwen2-style config ({gpu['parameters'] / 1e6:.0f}M parameters), "
                             f"generation {gpu['generation_tokens_per_s']:,} tokens/s, update step "
                             f"{gpu['update_tflops']} TFLOP/s, MFU {gpu['mfu']}" if gpu else
                             "Skipped: no CUDA device on this machine."), ""]
    return "\n".join(lines) + "\n"


def log_to_mlflow(report: dict[str, Any], json_path: Path, md_path: Path) -> str:
    import mlflow

    mlflow.set_experiment("grpo-benchmarks")
    with mlflow.start_run(run_name="grpo_vs_trl") as run:
        mlflow.log_params({"threads": report["threads"], "trl_version": report["trl_version"],
                           **{f"shared.{k}": v for k, v in SHARED.items()}})
        for r in report["sizes"]:
            mlflow.log_metric(f"{r['size']}.speedup_vs_trl", r["speedup_vs_trl"])
            mlflow.log_metric(f"{r['size']}.heldout_ours_minus_trl", r["heldout_ours_minus_trl"]["mean"])
            mlflow.log_metric(f"{r['size']}.heldout_warm_start", r["heldout_warm_start"])
            mlflow.log_param(f"{r['size']}.learning_rate", r["learning_rate"])
            for engine, e in r["engines"].items():
                for key in ("completions_per_s", "generated_tokens_per_s", "step_seconds_median", "step_seconds_p90",
                            "peak_rss_mb", "heldout_reward"):
                    mlflow.log_metric(f"{r['size']}.{engine}.{key}", e[key])
        if report.get("pipeline_overhead"):
            mlflow.log_metric("pipeline.overhead_share", report["pipeline_overhead"]["overhead_share"])
            for i, one in enumerate(report["pipeline_overhead"]["runs"]):
                mlflow.log_metric("pipeline.overhead_share_per_run", one["overhead_share"], step=i)
        mlflow.log_artifact(str(json_path))
        mlflow.log_artifact(str(md_path))
        return run.info.run_id


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,medium", help="comma-separated: tiny, medium")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds for the tiny model")
    parser.add_argument("--round-steps", type=int, default=40, help="steps per round for the tiny model")
    parser.add_argument("--medium-rounds", type=int, default=6)
    parser.add_argument("--medium-round-steps", type=int, default=8)
    parser.add_argument("--heldout", type=int, default=1000, help="held-out prompts per evaluation (>= 1000)")
    parser.add_argument("--no-eval-every-round", dest="eval_every_round", action="store_false",
                        help="evaluate only at the end (the time-to-TRL's-reward figure needs every round)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--no-pipeline", dest="pipeline", action="store_false",
                        help="skip running the default pipeline (`make run` in a scratch clone) for its overhead")
    parser.add_argument("--pipeline-runs", type=int, default=3,
                        help="`make run`s for the overhead, one fresh clone each; the median is reported")
    parser.add_argument("--work", default=str(ROOT / "benchmarks" / ".work"), help="scratch folder (reused)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--no-mlflow", dest="mlflow", action="store_false")
    args = parser.parse_args()
    for key, value in {"HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false",
                       "DVC_NO_ANALYTICS": "1", "GX_ANALYTICS_ENABLED": "false"}.items():
        os.environ.setdefault(key, value)
    try:
        import trl
    except ImportError:
        print('TRL is not installed: pip install -c constraints.txt -e ".[bench]"', file=sys.stderr)
        return 2
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    user_tracking = os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{ROOT / 'mlflow.db'}")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"  # set-up runs stay out of the user's store
    report: dict[str, Any] = {
        "command": "python benchmarks/grpo_vs_trl.py " + " ".join(sys.argv[1:]), "trl_version": trl.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "threads": args.threads, "shared_hyperparameters": SHARED, "sizes": []}
    import torch

    if torch.cuda.is_available():
        report["gpu"] = gpu_report()
    for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
        report["sizes"].append(compare_size(size, args, work))
    if args.pipeline:
        from benchmarks.pipeline_overhead import measure_runs

        print(f"measuring the default pipeline's orchestration overhead ({args.pipeline_runs} x make run, each in a "
              "fresh scratch clone) ...", flush=True)
        report["pipeline_overhead"] = measure_runs(work / "pipeline", args.pipeline_runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "grpo_vs_trl.json", out / "grpo_vs_trl.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(markdown(report))
    print(markdown(report))
    if args.mlflow:
        os.environ["MLFLOW_TRACKING_URI"] = user_tracking
        print(f"logged to MLflow run {log_to_mlflow(report, json_path, md_path)} ({user_tracking})")
    return 0


def gpu_report() -> dict[str, Any]:
    """On a CUDA device: a ~0.5B Qwen2-style config (random init), generation tokens/s and update-step MFU."""
    from benchmarks.gpu_throughput import measure_gpu

    return measure_gpu()


if __name__ == "__main__":
    sys.exit(main())
