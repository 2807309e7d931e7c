"""The calculator row of benchmarks/grpo_vs_trl.py, wired on tiny shapes: TRL's tool loop (`GRPOTrainer(tools=...)`)
is given the pipeline's prompts, chat template and call format token for token, runs the pipeline's calculator and
keeps its answer out of the model's tokens, and the benchmark counts both engines' episodes from their masks."""

from __future__ import annotations

import json
import string

import pytest

from benchmarks.grpo_vs_trl import ROWS, markdown, row_config, trl_settings
from benchmarks.trl_tools import (
    EpisodeCount,
    LayoutDiffers,
    answer_text,
    check_same_layout,
    mask_counts,
    template_with_calls,
    tool_row_inputs,
)

from conftest import ROOT

# SmolLM2-135M-Instruct's own chat template (its GGUF's), default system message included.
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
           "<|im_end|>\n' }}"
           "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 82"}}</tool_call>'


def chat_tokenizer():
    from components.engine.models.modeling import build_char_tokenizer

    tokenizer = build_char_tokenizer([string.printable])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = SMOLLM2
    return tokenizer


@pytest.fixture(scope="module")
def calculator_trl(tmp_path_factory):
    """The calculator row's config at one prompt x 2 episodes (256 tokens after the prompt: one character a token),
    a one-layer Llama with SmolLM2's template, and TRL's trainer built as the benchmark's worker builds it."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from components.data.tasks import multiplication

    cfg = row_config(ROWS["calculator"], ["grpo.prompts_per_step=1", "grpo.group_size=2",
                                              "grpo.max_completion_length=256"])
    records = multiplication(cfg.task, 0)["train"][:4]
    tokenizer, trl_tokenizer = chat_tokenizer(), chat_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    inputs = tool_row_inputs(cfg, records, tokenizer, trl_tokenizer)
    args = GRPOConfig(**trl_settings(cfg, 1, tmp_path_factory.mktemp("trl-out"), ROWS["calculator"].trl_memory))
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list(inputs.rows), processing_class=inputs.tokenizer,
                          tools=inputs.tools)
    return cfg, records, tokenizer, inputs, trainer


def test_trl_sees_the_pipelines_prompts_and_tool_answers_token_for_token(calculator_trl):
    cfg, records, tokenizer, inputs, trainer = calculator_trl
    checked = check_same_layout(trainer, inputs, records)
    assert checked["prompts_compared"] == 4 and checked["answers_compared"] == 2
    # the prompt is the pipeline's: its system message describes the tool (the template has no tool format)
    text = tokenizer.decode(inputs.chat.prompt_ids(inputs.first_messages(records[0])))
    assert '"name": "calculator"' in text and "<tool_call>" in text and "Reply with just the number." in text
    assert "SmolLM" not in text  # the tools' system message replaces the template's default one
    assert trainer.max_tool_calling_iterations == cfg.grpo.episode.max_turns - 1 == 2
    assert trainer.max_completion_length == cfg.grpo.max_completion_length == 256


def test_a_template_that_renders_tools_differently_is_caught(calculator_trl):
    _, records, _, inputs, trainer = calculator_trl
    original = trainer.processing_class.chat_template
    try:  # TRL handed a template that renders the tool message under another role
        trainer.processing_class.chat_template = original.replace("message['role']", "message['role'] | upper")
        with pytest.raises(LayoutDiffers, match="record 'train-000000'"):
            check_same_layout(trainer, inputs, records)
    finally:
        trainer.processing_class.chat_template = original
    with pytest.raises(LayoutDiffers, match="tool format of its own"):
        template_with_calls(original)


def test_trls_tool_loop_runs_the_calculator_and_keeps_its_answer_out_of_the_model_tokens(calculator_trl):
    """TRL's own loop (`_tool_call_loop`) after a first turn that calls the calculator as the SFT'd model writes it:
    the pipeline's calculator answers, its answer is laid out as ours lays it out, with mask 0, and the model's next
    turn follows with mask 1."""
    import torch
    from trl.chat_template_utils import parse_response

    from components.engine.generation.environments.builtin import calculator

    _, records, tokenizer, inputs, trainer = calculator_trl
    prompts = [inputs.first_messages(records[0])]
    prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
    first = tokenizer(CALL, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    parsed = parse_response(trainer.processing_class, first, prefix=prompt_ids[0], tools=inputs.tools)
    assert parsed["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "347 * 82"}}
    trainer._sync_tool_dicts, trainer._async_tool_dicts = [{"calculator": calculator}], [{}]
    torch.manual_seed(0)
    mask, messages, ids, _, calls, failures, _ = trainer._tool_call_loop(
        prompts, [list(prompt_ids[0])], [list(first)], [[parsed]], None, None, {})
    assert (calls, failures) == (1, 0)
    assert messages[0][1] == {"role": "tool", "name": "calculator", "content": "28454"}
    answer = inputs.chat.answer_ids([{"role": "tool", "name": "calculator", "content": "28454"}])
    assert ids[0][:len(first) + len(answer)] == first + answer
    assert mask[0][:len(first) + len(answer)] == [1] * len(first) + [0] * len(answer)
    after = len(ids[0]) - len(first) - len(answer)
    assert after > 0 and mask[0][len(first) + len(answer):] == [1] * after
    counts = mask_counts(ids, mask)
    assert counts == {"model_tokens": len(first) + after, "episode_tokens": len(ids[0]), "tool_answers": 1,
                      "turns": 2, "answered_after_tool": 1}


def test_mask_counts_by_hand():
    # episode 1: a turn, a tool answer, a turn; episode 2: one turn; episode 3: a turn, an answer, nothing after
    ids = [[5, 6, 7, 8, 9, 10], [1, 2], [3, 4, 4]]
    mask = [[1, 1, 0, 0, 1, 1], [1, 1], [1, 0, 0]]
    assert mask_counts(ids, mask) == {"model_tokens": 7, "episode_tokens": 11, "tool_answers": 2, "turns": 4,
                                      "answered_after_tool": 1}
    assert mask_counts(ids, None)["model_tokens"] == 11  # a single turn: every token the model's
    with pytest.raises(ValueError, match="does not cover"):
        mask_counts(ids, [[1], [1, 1], [1, 0, 0]])


def test_episode_count_sums_each_generate_call_until_taken(calculator_trl):
    tokenizer = calculator_trl[2]
    count = EpisodeCount(tokenizer)
    generate = count.wrap(lambda: ([[1, 2]], [[3, 4, 5]], [[1, 0, 1]], None))
    generate()
    generate()
    assert count.take() == {"model_tokens": 4, "episode_tokens": 6, "tool_answers": 2, "turns": 4,
                            "answered_after_tool": 2}
    assert count.take() == {} and count.sample == tokenizer.decode([1, 2, 3, 4, 5])


def test_trl_rewards_read_the_last_model_turn_as_ours_do():
    from components.engine.generation.rollouts import Episode

    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347 * 82"}}}
    answered = [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": "28454"}, {"role": "assistant", "content": "28454"}]
    assert answer_text(answered) == "28454"
    # out of turns while calling: ours reads the call as the model wrote it
    ours = Episode(({"role": "assistant", "content": CALL},), (), (), (), 1, True)
    assert answer_text(answered[:1]) == ours.answer == CALL


def test_the_report_states_the_tool_rows_figures_targets_and_differences():
    from benchmarks.trl_tools import TOOL_ROW_DIFFERENCES, episode_figures

    report = json.loads((ROOT / "benchmarks" / "results" / "grpo_vs_trl.json").read_text())
    row = dict(next(r for r in report["rows"] if r["row"] == "smollm2-long"), row="calculator")
    steps = [{"completions": 32.0, "tokens": 640.0, "episode_tokens": 900.0, "turns": 64.0, "tool_calls": 30.0,
              "tool_answers": 30.0, "answered_after_tool": 28.0}] * 2
    figures = episode_figures(steps)
    assert figures == {"episode_tokens_mean": 28.1, "turns_per_episode": 2.0, "tool_calls_per_episode": 0.938,
                       "tool_answers_per_episode": 0.938, "answered_after_tool_frac": 0.875}
    row["engines"] = {e: {**row["engines"][e], **figures, "model_tokens_per_s": 9.0} for e in ("ours", "trl")}
    row.update(tools=["calculator"], max_turns=3, model_tokens_per_s_ratio=3.21,
               per_round_model_token_ratios=[3.0, 3.3],
               layout={"prompts_compared": 16, "answers_compared": 2}, trl_sample_episode="<|im_start|>tool\n28454",
               targets={"model_tokens_per_s_ratio_at_least_3": True, "peak_rss_at_most_4000_mb": False},
               differences=list(TOOL_ROW_DIFFERENCES))
    text = markdown({**report, "rows": [row]})
    assert "**Model tokens/s, ours / TRL: 3.21x**" in text and "rounds: 3.00, 3.30" in text
    assert "model_tokens_per_s_ratio_at_least_3 met; peak_rss_at_most_4000_mb NOT met" in text
    assert "| tool answers per episode (TRL's mask) | 0.94 | 0.94 |" in text
    assert "16 prompts and 2 tool answers, token for token" in text and TOOL_ROW_DIFFERENCES[1] in text


def test_the_issues_targets_are_read_from_the_measured_figures():
    from benchmarks.trl_tools import tool_row_report

    cfg = row_config(ROWS["calculator"])
    engines = {"ours": {"peak_rss_mb": 3900.0}, "trl": {"peak_rss_mb": 7800.0}}
    notes = {"trl": {"layout": {"prompts_compared": 16}, "sample": "x"}}
    met = tool_row_report(cfg.grpo, engines, 3.0, {"ci95_low": -0.05}, notes)["targets"]
    assert all(met.values()) and len(met) == 4
    engines = {"ours": {"peak_rss_mb": 4001.0}, "trl": {"peak_rss_mb": 8002.0}}
    missed = tool_row_report(cfg.grpo, engines, 2.99, {"ci95_low": -0.051}, notes)["targets"]
    assert missed == {"model_tokens_per_s_ratio_at_least_3": False, "peak_rss_at_most_half_of_trl": True,
                      "peak_rss_at_most_4000_mb": False, "heldout_ci95_low_at_least_minus_0.05": False}
