"""What the model learns from: the built-in task, user datasets and the prompt template, with their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from components.config.rules import ConfigError, _require


@dataclass
class TaskConfig:
    """The embedded procedural task (used when no user data is given)."""

    name: Literal["addition", "addition_question", "word_problems", "multiplication"] = "addition"
    """Built-in task generator. `addition`: "37+45=" -> "82"; `addition_question`: "What is 37 + 45?" -> "82";
    `word_problems`: two-step word problems ("Ana has 7 apples. Ana buys 5 more and then gives 3 away. ...") -> "9";
    `multiplication`: "What is 347 * 82?" -> "28454" (an operand in [min_operand, max_operand] times a two-digit
    one: a task for the calculator tool)."""
    min_operand: int = 0
    """Smallest operand (inclusive)."""
    max_operand: int = 99
    """Largest operand (inclusive)."""
    n_sft: int = 1500
    """Demonstrations for the SFT warm start."""
    n_train: int = 4000
    """GRPO prompts (answers used only by the reward)."""
    n_heldout: int = 1000
    """Held-out evaluation prompts."""


@dataclass
class DataConfig:
    """User datasets. Any path set here replaces the generated split of the same name."""

    sft_path: str | None = None
    """Demonstrations for the SFT warm start (default with user data: the train split)."""
    train_path: str | None = None
    """GRPO prompts with answers (+ extra columns passed to rewards)."""
    heldout_path: str | None = None
    """Held-out evaluation data (default with user data: `heldout_ratio` of train_path, split off)."""
    format: Literal["auto", "jsonl", "json", "csv", "parquet", "hf"] = "auto"
    """File format; `auto` goes by extension (`hf`: a `datasets` save_to_disk directory)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Renames from source column to pipeline column, e.g. {question: prompt}; other columns are kept."""
    heldout_ratio: float = 0.1
    """Share of train_path held out when heldout_path is unset (identical prompts stay together)."""
    split_seed: int | None = None
    """Seed of that split (default: `seed`)."""


@dataclass
class PromptConfig:
    """How a record becomes the text the model sees."""

    template: str = "{prompt}"
    """Python format string over the record's fields, e.g. "Question: {prompt}\\nAnswer:"."""
    system: str | None = None
    """Optional system prompt (a system message with chat templates, a first line otherwise)."""
    chat_template: Literal["auto", "always", "never"] = "auto"
    """Apply the tokenizer's chat template with the generation prompt: `auto` when it has one."""



class _AnyField(dict):
    """Lets a template be checked for syntax without knowing the record's fields."""

    def __missing__(self, key: str) -> str:
        return ""


def check_task(t: TaskConfig) -> None:
    """task: operand range and split sizes that the generator can fill."""
    _require(0 <= t.min_operand <= t.max_operand, "task.max_operand", "must be >= task.min_operand >= 0")
    for name in ("n_sft", "n_train", "n_heldout"):
        _require(getattr(t, name) >= 1, f"task.{name}", "must be >= 1")
    if t.name != "word_problems":  # word_problems counts its own when it generates them (tasks.py)
        span = (t.max_operand - t.min_operand + 1) * (90 if t.name == "multiplication" else
                                                      t.max_operand - t.min_operand + 1)
        _require(t.n_sft + t.n_train + t.n_heldout <= span, "task.n_train",
                 f"n_sft + n_train + n_heldout exceeds the {span} distinct problems of the operand range")


def check_data(d: DataConfig) -> None:
    """data: the held-out share and the column renames."""
    _require(0 < d.heldout_ratio < 1, "data.heldout_ratio", "must be in (0, 1)")
    for source, target in d.columns.items():
        _require(isinstance(target, str) and bool(target), f"data.columns.{source}", "must name a target column")


def check_prompt(p: PromptConfig) -> None:
    """prompt: the template is a valid format string."""
    try:
        p.template.format_map(_AnyField())
    except (ValueError, IndexError) as err:
        raise ConfigError(f"prompt.template: not a valid format string ({err})") from err
