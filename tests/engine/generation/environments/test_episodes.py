"""Episodes (components/engine/generation/environments/): the conversation laid out token by token, the model's tokens
alone in the loss, TRL 1.16's tool-result tokens and masking rule, limits, and environments that fail."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch

from components.config import ConfigError, GRPOConfig
from components.engine.generation.engines.base import SamplingParams
from components.engine.generation.engines.turns import Reencoding
from components.engine.generation.environments.chat import ChatFormat, conversation_ids
from components.engine.generation.environments.environment import ToolEnvironment, load_environment_factory
from components.engine.generation.environments.episodes import EnvironmentFailed, EpisodeLimits, Episodes
from components.engine.generation.environments.tools import load_tools
from components.engine.generation.logprobs import completion_logprobs
from components.engine.generation.rollouts import Turn, left_pad
from components.engine.generation.service import Generation
from components.engine.grpo.policy import Policy
from components.engine.grpo.trajectory import build_trajectory, loss_mask
from components.engine.grpo.update import policy_updates
from components.losses import LOSSES
from tests.engine.generation.environments.chat_fixtures import CHATML, HERMES, chat_tokenizer

FIXTURES = "tests.engine.generation.environments.tool_fixtures"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'


class ScriptedEngine:
    """An engine whose model writes the given turns in order (each call: the next turn of every row), so an episode's
    layout can be checked position by position. The episode loop, environments and masks under test are real."""

    name = "scripted"

    def __init__(self, tokenizer, turns: Sequence[str]):
        self.tokenizer, self.turns, self.calls = tokenizer, list(turns), 0

    def start(self, prompts, continuing=False):
        return Reencoding(self, prompts)

    def sample(self, prompts, params: SamplingParams, generator=None) -> Turn:
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        turn = self.tokenizer(text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
        turn = turn[: params.max_new_tokens]
        rows = [p for p in prompts for _ in range(params.n)]
        ids, mask = left_pad(rows, self.tokenizer.pad_token_id)
        completion = torch.tensor([turn] * len(rows))
        logp = -torch.arange(1, len(turn) + 1, dtype=torch.float32).repeat(len(rows), 1) / 10
        return Turn(ids, mask, completion, torch.ones_like(completion), completion[:, -1] != 3, params.n, logp)

    def logprobs(self, rollouts, temperature, with_entropy=False):
        raise NotImplementedError

    def over(self, model):
        return self


class Runner:
    """A play run through `Generation` over any engine."""

    def __init__(self, play, tokenizer):
        self.play, self.tokenizer = play, tokenizer

    def run(self, engine, records, params, generator=None):
        return Generation(engine, self.play, self.tokenizer).run(records, params, generator)

    def read(self, rollouts):
        return Generation(None, self.play, self.tokenizer).read(rollouts)


def _runner(tokenizer, tools=("add",), max_turns=4, timeout_s=1.0, cut_reward=0.0):
    chat = ChatFormat(tokenizer, [t.schema for t in load_tools([f"{FIXTURES}:{n}" for n in tools])])
    loaded = load_tools([f"{FIXTURES}:{n}" for n in tools])

    def first(record):
        return [{"role": "user", "content": record["prompt"]}]

    limits = EpisodeLimits(max_turns=max_turns, timeout_s=timeout_s, cut_reward=cut_reward)
    return Runner(Episodes(chat, lambda: ToolEnvironment(loaded, first, timeout_s, tokenizer), limits), tokenizer)


def _environment_runner(tokenizer, name, limits=None, describe="environment"):
    return Runner(Episodes(ChatFormat(tokenizer), load_environment_factory(f"{FIXTURES}:{name}"),
                           limits or EpisodeLimits(max_turns=4, timeout_s=1.0), describe), tokenizer)


def test_an_episode_is_laid_out_as_its_conversation_with_only_the_models_tokens_marked():
    tokenizer = chat_tokenizer()
    rollouts = _runner(tokenizer).run(ScriptedEngine(tokenizer, [CALL, "7"]), [{"prompt": "3+4?"}],
                                      SamplingParams(n=2, max_new_tokens=400))
    assert rollouts.group_size == 2 and len(rollouts) == 2
    decode = tokenizer.decode
    row, written = rollouts.completion_ids[0].tolist(), rollouts.model_mask[0].tolist()
    assert decode(rollouts.prompt_ids[0]) == "<|im_start|>user\n3+4?<|im_end|>\n<|im_start|>assistant\n"
    assert decode(row) == (CALL + "<|im_end|>\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n7<|im_end|>")
    answer = tokenizer("\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    assert written == [1] * (len(CALL) + 1) + [0] * len(answer) + [1] * 2  # both turns and their EOS, not the answer
    assert decode([t for t, w in zip(row, written) if w]) == CALL + "<|im_end|>7<|im_end|>"
    assert (rollouts.sampling_logp[0][torch.tensor(written) == 0] == 0).all()  # no sampler log-prob for tool tokens
    episode = rollouts.episodes[0]
    assert (episode.turns, episode.tool_calls, episode.tool_errors, episode.cut) == (2, 1, 0, None)
    assert episode.answer == "7" and episode.messages[1] == {"role": "tool", "name": "add", "content": "7"}
    reading = _runner(tokenizer).read(rollouts)
    texts, columns = reading.texts, reading.columns
    assert texts == ["7", "7"] and columns["tool_calls"] == [1, 1] and columns["turns"] == [2, 2]
    assert columns["episode"][0][0]["content"] == CALL and not rollouts.truncated.any()


def test_a_hand_built_conversation_has_the_episodes_layout_token_for_token():
    """SFT's worked conversations and GRPO's episodes put the same tokens in the same places: the conversation as the
    chat template renders it (the tool call as the model writes it), up to the last EOS; the model's turns and their
    EOS marked, nothing else."""
    tokenizer = chat_tokenizer()
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3 * 4"}}}
    messages = [{"role": "user", "content": "What is 3 * 4?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": "12"}, {"role": "assistant", "content": "12"}]
    ids, mask, prompt_length = conversation_ids(ChatFormat(tokenizer), messages)
    written = '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 4"}}</tool_call>'
    as_written = [messages[0], {"role": "assistant", "content": written}, messages[2], messages[3]]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(as_written, tokenize=False)[: -len("\n")]
    # one token a character; <|im_start|> and <|im_end|> one each
    answer = len("\n") + 1 + len("tool\n12") + 1 + len("\n") + 1 + len("assistant\n")
    assert mask == [0] * prompt_length + [1] * (len(written) + 1) + [0] * answer + [1] * (len("12") + 1)


class TRLStandIn:
    """What `GRPOTrainer._get_tool_suffix_ids` reads of its trainer."""

    def __init__(self, tokenizer):
        self.processing_class = self._tokenizer = tokenizer
        self.chat_template, self.chat_template_kwargs, self._is_vlm = None, {}, False


@pytest.mark.parametrize("template", ["chatml", "hermes"])
def test_tool_result_tokens_and_the_mask_follow_trls_rule(template):
    """TRL 1.16 exposes the tokens it inserts after a model turn with tool calls (`_get_tool_suffix_ids`) and masks
    them out (`tool_mask += [0] * tool_length + [1] * post_tool_length`): ours are the same tokens, masked the same."""
    trl = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is the reference")
    tokenizer = chat_tokenizer(HERMES if template == "hermes" else CHATML)
    tool_messages = [{"role": "tool", "name": "add", "content": "7"}]
    chat = ChatFormat(tokenizer, [t.schema for t in load_tools([f"{FIXTURES}:add"])])
    theirs = trl.GRPOTrainer._get_tool_suffix_ids(TRLStandIn(tokenizer), tool_messages)
    assert chat.answer_ids(tool_messages) == theirs
    rollouts = _runner(tokenizer).run(ScriptedEngine(tokenizer, [CALL, "7"]), [{"prompt": "3+4?"}],
                                      SamplingParams(n=1, max_new_tokens=400))
    turn = len(tokenizer(CALL, add_special_tokens=False).input_ids) + 1
    trl_mask = [1] * turn
    trl_mask += [0] * len(theirs) + [1] * 2  # TRL's update after the tool round
    assert rollouts.model_mask[0].tolist() == trl_mask


def test_the_loss_the_kl_and_the_entropy_see_only_the_models_tokens():
    """For every loss in the table the update's loss (policy term and KL against a reference that differs) and its
    entropy statistic are the hand-built ones over the model's tokens: a tool token in them would change both."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from components.engine.grpo.objectives import build_loss

    tokenizer = chat_tokenizer()
    rollouts = _runner(tokenizer).run(ScriptedEngine(tokenizer, [CALL, "7"]), [{"prompt": "3+4?"}, {"prompt": "1+1?"}],
                                      SamplingParams(n=2, max_new_tokens=400))
    assert torch.equal(loss_mask(rollouts, torch.ones(4, dtype=torch.bool), mask_truncated=False),
                       rollouts.model_mask)
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=512))
    reference = copy.deepcopy(base).eval().requires_grad_(False)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for loss_type in LOSSES:
        g = GRPOConfig(group_size=2, prompts_per_step=2, kl_beta=0.1, loss_type=loss_type, max_completion_length=400,
                       max_grad_norm=1e9)
        loss, model = build_loss(g), copy.deepcopy(base)
        policy = Policy.of(tokenizer, model, reference=reference)
        ref = policy.reference_logprobs(rollouts)
        trajectory = build_trajectory(rollouts, [1.0, 0.0, -1.0, 0.5], loss, False, ref)
        stats = policy_updates(policy, torch.optim.SGD(model.parameters(), lr=0.0), trajectory, g, loss)
        logp, entropy = completion_logprobs(model, rollouts, 1.0, with_entropy=True)
        mask, every = rollouts.model_mask, rollouts.completion_mask
        expected = loss(logp, logp.detach(), trajectory.advantages, mask, ref_logp=ref)
        leaky = loss(logp, logp.detach(), trajectory.advantages, every, ref_logp=ref)
        assert stats.loss == pytest.approx(float(expected.loss), rel=1e-5), loss_type
        assert abs(float(leaky.loss) - float(expected.loss)) > 1e-4, "the check would not see a leak"
        assert stats.entropy == pytest.approx(float((entropy * mask).sum() / mask.sum()), rel=1e-5)


def test_limits_end_episodes_and_say_which():
    tokenizer = chat_tokenizer()
    turns = _runner(tokenizer, max_turns=2).run(ScriptedEngine(tokenizer, [CALL]), [{"prompt": "3+4?"}],
                                                SamplingParams(n=1, max_new_tokens=400))
    assert turns.episodes[0].cut == "turns" and turns.episodes[0].turns == 2 and turns.truncated.all()
    tokens = _runner(tokenizer).run(ScriptedEngine(tokenizer, [CALL, "7"]), [{"prompt": "3+4?"}],
                                    SamplingParams(n=1, max_new_tokens=len(CALL) + 10))
    assert tokens.episodes[0].cut == "tokens" and tokens.written.all()  # the answer that did not fit is dropped
    short = _runner(tokenizer).run(ScriptedEngine(tokenizer, [CALL]), [{"prompt": "3+4?"}],
                                   SamplingParams(n=1, max_new_tokens=10))
    assert short.episodes[0].cut == "tokens" and short.completion_ids.shape[1] == 10


class FirstTurnPerRow(ScriptedEngine):
    """The first turn's rows write the given texts (a text without "$" ends with EOS; with it, it runs to the budget
    and is cut there); later turns write the last text."""

    def __init__(self, tokenizer, first: Sequence[str]):
        super().__init__(tokenizer, [first[-1]])
        self.first = list(first)

    def sample(self, prompts, params: SamplingParams, generator=None) -> Turn:
        if self.calls:
            return super().sample(prompts, params, generator)
        self.calls += 1
        eos = self.tokenizer.eos_token_id
        rows = [self.tokenizer(t.replace("$", "9" * params.max_new_tokens), add_special_tokens=False).input_ids
                + ([] if "$" in t else [eos]) for t in self.first]
        rows = [r[: params.max_new_tokens] for r in rows]
        ids, mask = left_pad([p for p in prompts for _ in range(params.n)], self.tokenizer.pad_token_id)
        width = max(map(len, rows))
        completion = torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        written = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        truncated = torch.tensor([eos not in r for r in rows])
        return Turn(ids, mask, completion, written, truncated, params.n, -written.float() / 10)


@pytest.mark.parametrize("factory, cut_score", [("guess_number", 0.5), ("guess_number_scoring_cuts", -0.5)])
def test_episodes_cut_by_a_limit_are_scored_and_compared(factory, cut_score):
    """A guess-the-number environment with a token budget that cuts most episodes: the cut ones are scored (the
    environment's `on_cut`, else `grpo.episode.cut_reward`), so the group's advantages are not all zero; without
    that they would be left out of the comparison and the one scored episode would have no one to beat."""
    from components.config import RewardSpec
    from components.engine.grpo.objectives import group_advantages
    from components.engine.rewards.rewards import RewardModel

    tokenizer = chat_tokenizer()
    limits = EpisodeLimits(max_turns=3, timeout_s=1.0, cut_reward=0.5)
    runner = _environment_runner(tokenizer, factory, limits)
    engine = FirstTurnPerRow(tokenizer, ["7", "$", "$", "$"])  # a hit, then three that ramble past the budget
    rollouts = runner.run(engine, [{"prompt": "?"}], SamplingParams(n=4, max_new_tokens=12))
    assert [e.cut for e in rollouts.episodes] == [None, "tokens", "tokens", "tokens"]
    reading = runner.read(rollouts)
    assert reading.columns["environment_reward"] == [1.0, cut_score, cut_score, cut_score]
    totals = RewardModel([RewardSpec("environment_reward")])(["?"] * 4, reading.texts, reading.columns).total
    advantages = group_advantages(torch.tensor(totals, dtype=torch.float32), 4)
    assert (advantages != 0).all() and advantages[0] > 0


def test_a_turn_limit_cut_is_scored_too():
    tokenizer = chat_tokenizer()
    runner = _environment_runner(tokenizer, "guess_number_scoring_cuts", EpisodeLimits(max_turns=2, timeout_s=1.0))
    rollouts = runner.run(ScriptedEngine(tokenizer, ["1"]), [{"prompt": "?"}], SamplingParams(n=1, max_new_tokens=400))
    assert rollouts.episodes[0].cut == "turns" and rollouts.episodes[0].reward == -0.25


def test_a_tool_that_fails_is_an_error_in_the_conversation_not_a_crashed_step():
    tokenizer = chat_tokenizer()
    call = '<tool_call>{"name": "boom", "arguments": {"x": "?"}}</tool_call>'
    rollouts = _runner(tokenizer, tools=("boom",)).run(ScriptedEngine(tokenizer, [call, "sorry"]), [{"prompt": "?"}],
                                                       SamplingParams(n=1, max_new_tokens=400))
    episode = rollouts.episodes[0]
    assert episode.messages[1]["content"] == "error: RuntimeError: tool exploded"
    assert (episode.tool_calls, episode.tool_errors, episode.cut) == (1, 1, None)
    malformed = _runner(tokenizer).run(ScriptedEngine(tokenizer, ["<tool_call>{oops</tool_call>", "x"]),
                                       [{"prompt": "?"}], SamplingParams(n=1, max_new_tokens=400))
    assert malformed.episodes[0].messages[1]["content"].startswith("error: malformed tool call (not JSON")
    assert malformed.episodes[0].tool_errors == 1


def test_an_environment_is_played_turn_by_turn_and_its_reward_kept():
    tokenizer = chat_tokenizer()
    runner = _environment_runner(tokenizer, "echo")
    rollouts = runner.run(ScriptedEngine(tokenizer, ["hi", "bye"]), [{"prompt": "Ana"}],
                          SamplingParams(n=1, max_new_tokens=400))
    episode = rollouts.episodes[0]
    assert [m["content"] for m in episode.messages] == ["hi", "HI", "bye"] and episode.reward == 1.0
    assert runner.read(rollouts).columns["environment_reward"] == [1.0]


@pytest.mark.parametrize("name, raised", [("broken", "ValueError: the environment broke"),
                                          ("quitter", "SystemExit: the environment quit")])
def test_an_environment_failing_on_most_episodes_stops_the_stage_in_one_line(name, raised):
    tokenizer = chat_tokenizer()
    runner = _environment_runner(tokenizer, name, describe=f"{FIXTURES}:{name}")
    with pytest.raises(EnvironmentFailed, match=rf"{name} failed on 2 of 2 episodes in one turn .* the first: "
                                                 rf"environment error: {raised}") as err:
        runner.run(ScriptedEngine(tokenizer, ["hi"]), [{"prompt": "x"}], SamplingParams(n=2, max_new_tokens=9))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, message", [
    (f"{FIXTURES}:no_step", r"grpo.environment: .* builds object, which has no reset and no step method"),
    ("tests.engine.generation.environments.nowhere:echo", r"grpo.environment: cannot import module"),
])
def test_an_environment_that_cannot_be_used_is_refused_before_training(name, message):
    with pytest.raises(ConfigError, match=message):
        load_environment_factory(name)


def test_tools_and_an_environment_together_are_refused():
    from components.config import load_config

    from conftest import committed_params

    with pytest.raises(ConfigError, match="grpo.environment: cannot be set together with grpo.tools"):
        load_config(committed_params(), ["grpo.tools=[calculator]", f"grpo.environment={FIXTURES}:echo"])


def test_episodes_through_every_engine_draw_the_plain_engines_tokens():
    """A real (tiny, random) model plays tool episodes through every engine of the table: the same
    turns, tool answers and masks for one seed, and the sampler's log-probs of the model's tokens are the model's."""
    tokenizer = chat_tokenizer()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512)).eval()
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] += 0.3 * model.model.embed_tokens.weight.sum(0)
    from components.engine.generation.engines.base import EngineRun, SpecialTokens
    from components.engine.generation.engines.choose import conformance_engine
    from components.rollout_engines import ENGINES

    tokens = SpecialTokens.of(tokenizer)
    run = EngineRun(vocab_size=len(tokenizer), max_length=200, completion_length=40)
    out = {}
    for name in ENGINES:  # every entry of the engine table, the plain one first
        out[name] = _runner(tokenizer).run(conformance_engine(model, tokens, run, name),
                                           [{"prompt": "3+4?"}, {"prompt": "9+9?"}],
                                           SamplingParams(n=3, max_new_tokens=60), torch.Generator().manual_seed(1))
    plain = out[next(iter(ENGINES))]
    for name, rollouts in out.items():
        assert torch.equal(rollouts.completion_ids, plain.completion_ids), name
        assert torch.equal(rollouts.written, plain.written), name
    rollouts = plain
    written = rollouts.written
    logp, _ = completion_logprobs(model, rollouts)
    torch.testing.assert_close(rollouts.sampling_logp[written], logp[written], atol=1e-5, rtol=1e-5)

