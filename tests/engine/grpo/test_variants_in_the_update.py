"""The newer GRPO options inside a real update and config: the on-policy check (the sampler's log-probs against
the trainer's), entropy masking wired through `policy_updates`, and the rules that refuse what makes no sense.
Their maths against TRL: test_against_trl.py."""

from __future__ import annotations

import copy

import pytest
import torch

from components.config import ConfigError, GRPOConfig, MonitorsConfig, RewardSpec, load_config
from components.config.pipeline import config_warnings
from components.engine.evaluation.monitors import Monitors
from components.engine.generation.engines.base import SamplingParams, SpecialTokens
from components.engine.generation.engines.hf import HFEngine
from components.engine.generation.engines.prefix_shared import PrefixSharedEngine
from components.engine.generation.fast.fastlm import PrefixSharedLM
from components.engine.generation.logprobs import completion_logprobs
from components.engine.generation.rollouts import encode_prompts
from components.engine.grpo.objectives import build_loss, high_entropy_mask
from components.engine.grpo.policy import Policy
from components.engine.grpo.update import policy_updates
from components.engine.parallel.distributed import DistContext
from tests.engine.grpo.trajectories import trajectory

from conftest import committed_params


@pytest.fixture(scope="module")
def tiny_model():
    from components.config import TinyModelConfig
    from components.engine.models.modeling import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer(["0123456789+="])
    return tok, build_tiny_model(TinyModelConfig(), tok, seed=0)


def sample(tok, model, temperature=1.0, top_k=0, engine=None):
    engine = engine or HFEngine(model, SpecialTokens.of(tok))
    return engine.sample(encode_prompts(tok, [f"{i}+{i + 3}=" for i in range(4)]),
                         SamplingParams(n=4, max_new_tokens=5, temperature=temperature, top_k=top_k),
                         torch.Generator().manual_seed(0))


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampler_logprobs_are_the_full_distribution_at_the_temperature(tiny_model, top_k):
    """What the loss scores: log softmax(logits / T) of the drawn token, before top-k (TRL's choice too)."""
    tok, model = tiny_model
    rollout = sample(tok, model.eval(), temperature=0.7, top_k=top_k)
    with torch.no_grad():
        expected, _ = completion_logprobs(model, rollout, 0.7)
    mask = rollout.completion_mask.bool()
    assert mask.sum() > 10 and (rollout.sampling_logp[~mask] == 0).all()
    torch.testing.assert_close(rollout.sampling_logp[mask], expected[mask], rtol=0, atol=2e-5)


@pytest.mark.parametrize("fast", [False, True], ids=["hugging-face", "prefix-shared"])
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_on_policy_gap_is_rounding_when_sampler_and_trainer_agree(tiny_model, fast, num_iterations):
    """Every sampled token is compared once, against the weights that sampled it (also with mu = 2, whose second
    pass runs on moved weights)."""
    tok, base = tiny_model
    model = copy.deepcopy(base).eval()
    engine = PrefixSharedEngine(PrefixSharedLM(model), SpecialTokens.of(tok)) if fast else None
    rollout = sample(tok, model, engine=engine)
    g = GRPOConfig(group_size=4, prompts_per_step=4, kl_beta=0.0, num_iterations=num_iterations)
    policy = Policy.of(tok, model.train(), engine)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    stats = policy_updates(policy, opt, trajectory(rollout, torch.linspace(-1, 1, 16), policy=policy, g=g), g)
    assert stats.gap_tokens == rollout.completion_mask.sum()
    assert stats.gap_sum / stats.gap_tokens < 1e-5 and stats.gap_max < 1e-4


def test_a_sampler_that_disagrees_shows_in_the_gap_and_the_monitor(tiny_model):
    """A sampler drawing at another temperature than the trainer scores (a stand-in for a kernel or cache bug)."""
    tok, base = tiny_model
    model = copy.deepcopy(base)
    rollout = sample(tok, model.eval(), temperature=0.5)
    g = GRPOConfig(group_size=4, prompts_per_step=4, kl_beta=0.0, temperature=1.0)
    stats = policy_updates(Policy.of(tok, model.train()), torch.optim.SGD(model.parameters(), lr=0.1),
                           trajectory(rollout, torch.linspace(-1, 1, 16)), g)
    gap = stats.gap_sum / stats.gap_tokens
    assert gap > 0.01
    monitors = Monitors(MonitorsConfig(), "reward")
    breaches = monitors.check([{"step": 1, "reward_mean": 0.0, "logprob_gap_mean": gap}])
    assert [b.signal for b in breaches] == ["logprob_gap"] and breaches[0].action == "warn"
    assert not Monitors(MonitorsConfig(), "reward").check([{"step": 1, "reward_mean": 0.0, "logprob_gap_mean": 1e-6}])


def test_entropy_masking_trains_on_the_high_entropy_tokens_only(tiny_model):
    """The update's gradient is that of the loss with the policy's own top-30% entropy mask over the tokens the loss
    sees (SGD, lr 1: the weights move by minus the gradient). Half the rows are out of the loss (unscored): the
    quantile's pool is the loss mask, which here picks other tokens than the completion mask would."""
    tok, base = tiny_model
    rollout = sample(tok, base.eval())
    adv = torch.linspace(-1, 2, 16)
    reference = copy.deepcopy(base).train()
    logp, entropy = completion_logprobs(reference, rollout, 1.0, with_entropy=True)
    row_entropy = (entropy * rollout.completion_mask).amax(-1)
    scorable = row_entropy < row_entropy.median()  # the rows holding the highest entropies are out of the loss
    loss_mask = rollout.completion_mask * scorable[:, None]
    g = GRPOConfig(group_size=4, prompts_per_step=4, kl_beta=0.0, top_entropy_quantile=0.3, max_grad_norm=1e9)
    model = copy.deepcopy(base).train()
    before = [p.detach().clone() for p in model.parameters()]
    policy_updates(Policy.of(tok, model), torch.optim.SGD(model.parameters(), lr=1.0),
                   trajectory(rollout, adv, loss_mask, scorable=scorable), g)
    token_mask = high_entropy_mask(entropy, loss_mask, 0.3)
    assert 0 < token_mask.sum() < loss_mask.sum()
    assert not torch.equal(token_mask, high_entropy_mask(entropy, rollout.completion_mask, 0.3) & loss_mask.bool())
    build_loss(g)(logp, logp.detach(), adv, loss_mask, num_sequences=float(scorable.sum()),
                  token_mask=token_mask).loss.backward()
    for old, new, p in zip(before, model.parameters(), reference.parameters()):
        torch.testing.assert_close(old - new, p.grad, rtol=1e-4, atol=1e-6)


def test_entropy_masking_runs_in_every_pass(tiny_model):
    """With mu = 2 the second pass needs entropies too (the mask is the current policy's), not only the first."""
    tok, base = tiny_model
    rollout = sample(tok, base.eval())
    g = GRPOConfig(group_size=4, prompts_per_step=4, kl_beta=0.0, top_entropy_quantile=0.3, num_iterations=2)
    model = copy.deepcopy(base).train()
    policy = Policy.of(tok, model)
    stats = policy_updates(policy, torch.optim.SGD(model.parameters(), lr=0.1),
                           trajectory(rollout, torch.linspace(-1, 2, 16), policy=policy, g=g), g)
    assert stats.updates == 2 and stats.skipped_updates == 0


def config(*overrides: str):
    return load_config(committed_params(), list(overrides))


@pytest.mark.parametrize("overrides,key", [
    (["grpo.algorithm=reinforce", "grpo.group_size=1", "grpo.kl_beta=0", "grpo.loss_type=cispo"], "grpo.loss_type"),
    (["grpo.algorithm=reinforce", "grpo.group_size=1", "grpo.kl_beta=0", "grpo.loss_type=sapo"], "grpo.loss_type"),
    (["grpo.loss_type=cispo", "grpo.epsilon_high=0.28"], "grpo.epsilon_high"),
    (["grpo.loss_type=cispo", "grpo.cispo_max_ratio=0"], "grpo.cispo_max_ratio"),
    (["grpo.loss_type=sapo", "grpo.sapo_temperature_neg=0"], "grpo.sapo_temperature_neg"),
    (["grpo.top_entropy_quantile=1.5"], "grpo.top_entropy_quantile"),
    (["grpo.top_entropy_quantile=0.2", "grpo.importance_sampling_level=sequence", "grpo.loss_type=grpo"],
     "grpo.top_entropy_quantile"),
    (["grpo.top_entropy_quantile=0.2", "distributed.nproc=2"], "grpo.top_entropy_quantile"),
    (["grpo.multi_objective_aggregation=normalize_then_sum"], "grpo.multi_objective_aggregation"),
    (["grpo.multi_objective_aggregation=normalize_then_sum", "grpo.overlong.enabled=true",
      "grpo.scale_rewards=none"], "grpo.scale_rewards"),
])
def test_variants_refused_where_they_make_no_sense(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(*overrides)


def test_variants_accepted_where_they_make_sense():
    config("grpo.loss_type=cispo", "grpo.num_iterations=2")
    config("grpo.loss_type=cispo", "grpo.importance_sampling_level=sequence", "grpo.top_entropy_quantile=0.2")
    config("grpo.multi_objective_aggregation=normalize_then_sum", "grpo.overlong.enabled=true")
    cfg = config("grpo.top_entropy_quantile=0.2")
    assert build_loss(cfg.grpo).masks_by_entropy and not build_loss(config().grpo).masks_by_entropy


@pytest.mark.parametrize("loss_type,same_as", [("cispo", "dapo"), ("sapo", "grpo")])
def test_cispo_and_sapo_on_policy_are_warned(loss_type, same_as):
    warned = config_warnings(config(f"grpo.loss_type={loss_type}"))
    assert any(f"update is {same_as}'s" in w for w in warned)
    assert not any("importance ratio" in w for w in config_warnings(config(f"grpo.loss_type={loss_type}",
                                                                            "grpo.num_iterations=2")))
    assert not any("importance ratio" in w for w in config_warnings(config(
        f"grpo.loss_type={loss_type}", "grpo.minibatch_size=32", "grpo.gradient_accumulation_steps=1")))


def test_the_default_keeps_every_token_and_one_sum():
    g = config().grpo
    assert (g.loss_type, g.top_entropy_quantile, g.multi_objective_aggregation) == ("dapo", 1.0, "sum_then_normalize")
    assert GRPOConfig(rewards=[RewardSpec(), RewardSpec("distinct_ngrams")]).multi_objective_aggregation == \
        "sum_then_normalize"


@pytest.mark.parametrize("collector", ["one sampler, refills", "a sampler per group"])
def test_both_collectors_keep_the_sampler_logprobs_and_the_raw_reward_curve(tiny_model, collector):
    """Row for row through dynamic sampling's refills and concatenation, or the per-group path's CPU round trip;
    with GDPO the batch's totals are the normalised sums while the logged curve stays the weighted sums."""
    from components.engine.grpo.batch import (
        PromptSchedule,
        collect_batch,
        one_process_round,
        per_group_round,
        sampling_params,
    )
    from components.engine.rewards.rewards import RewardModel

    tok, base = tiny_model
    model = copy.deepcopy(base).eval()
    records = [{"prompt": f"{i}+{i + 1}=", "answer": str(2 * i + 1)} for i in range(8)]
    g = GRPOConfig(group_size=4, prompts_per_step=4, max_completion_length=4, multi_objective_aggregation=
                   "normalize_then_sum", rewards=[RewardSpec("exact_match"), RewardSpec("distinct_ngrams", 2.0,
                                                                                            {"n": 1})])
    g.dynamic_sampling.enabled = g.dynamic_sampling.fill_batch = True
    rewards = RewardModel(g.rewards)
    policy = Policy.of(tok, model)
    rounds = per_group_round(policy, records, sampling_params(g), rewards, g, 0, DistContext()) \
        if collector == "a sampler per group" else \
        one_process_round(policy, records, sampling_params(g), rewards, g, torch.Generator().manual_seed(0))
    batch = collect_batch(rounds, PromptSchedule(8, 4, 0), 0, g, tok.pad_token_id)
    rollout = batch.rollouts
    assert len(rollout) and rollout.sampling_logp.shape == rollout.completion_ids.shape
    # Each kept group's record is the one its rows were sampled from (groups dropped and refilled in between).
    assert len(batch.records) == rollout.num_groups
    for k, record in enumerate(batch.records):
        row = k * rollout.group_size
        assert rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist() == \
            encode_prompts(tok, [record["prompt"]])[0], k
    kept = [records.index(record) for record in batch.records]
    assert kept != PromptSchedule(8, 4, 0).indices(0), "no group was dropped: the records' order tests nothing"
    with torch.no_grad():
        expected, _ = completion_logprobs(model, rollout, g.temperature)
    mask = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.sampling_logp[mask], expected[mask], rtol=0, atol=2e-5)
    first = batch.rewards
    weighted = [sum(w * (s or 0.0) for w, s in zip([1.0, 2.0], col)) for col in zip(*first.components.values())]
    assert first.total == pytest.approx(weighted)  # the raw weighted sums, not GDPO's normalised ones
    assert max(first.total) > 1.0 and max(abs(t) for t in batch.advantage_rewards) < 10  # sums up to 3; normalised


def test_a_rollout_without_sampler_logprobs_is_not_concatenated_silently():
    from components.engine.generation.rollouts import Turn, concat_rollouts

    ids, mask = torch.tensor([[5, 6]]), torch.tensor([[1, 1]])
    a = Turn(ids, mask, ids, mask, torch.zeros(1, dtype=torch.bool), sampling_logp=torch.zeros(1, 2))
    b = Turn(ids, mask, ids, mask, torch.zeros(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="sampler's log-probs"):
        concat_rollouts([a, b], 0)
    assert concat_rollouts([a, a], 0).sampling_logp.shape == (2, 2)
