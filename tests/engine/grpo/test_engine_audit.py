"""The engine audit's findings (issue: GRPO engine audit): each defect pinned by a test that failed
before its fix, and tests for lines no other test could see break (truncation masking, the frozen
reference, the KL estimators' gradients)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from components.config import ConfigError, GRPOConfig, config_warnings, load_config, stage_params_hash
from components.engine.generation.engines.base import SamplingParams, SpecialTokens
from components.engine.generation.engines.prefix_shared import PrefixSharedEngine
from components.engine.generation.fast.build import checked_prefix_shared_lm
from components.engine.generation.fast.rows import full_attention
from components.engine.generation.logprobs import completion_logprobs
from components.engine.generation.rollouts import Turn
from components.engine.grpo.batch import informative_groups
from components.engine.grpo.objectives import GRPOLoss, group_advantages, kl_estimate, policy_loss
from components.engine.grpo.policy import Policy
from components.engine.grpo.trajectory import Trajectory, loss_mask
from components.engine.grpo.update import UpdatePlan, old_logprobs, policy_updates
from components.engine.rewards.rewards import RewardModel
from components.losses import ClipRange
from tests.engine.sampling import sample_texts

from conftest import committed_params

PARAMS = committed_params()
VOCAB = 24


# ----------------------------------------------------------------------------- 1. the resume key
def test_resume_key_covers_every_param_dvc_reruns_grpo_for():
    base = load_config(PARAMS)
    key = stage_params_hash(base, "grpo", "data", "model")
    # Both were left out of the key before: a prompt template or dtype change resumed the old policy.
    for override in ("prompt.template=Question {prompt}", "model.dtype=float32", "threads=1",
                     "distributed.per_group_sampling=true", "grpo.kl_beta=0.1", "seed=7"):
        assert stage_params_hash(load_config(PARAMS, [override]), "grpo", "data", "model") != key, override
    # ... and the data and the starting model's hashes.
    assert stage_params_hash(base, "grpo", "other data", "model") != key
    assert stage_params_hash(base, "grpo", "data", "other model") != key
    # Params DVC does not list for grpo leave the key (and the checkpoints) alone; so does moving a
    # per-group-seeded run to another number of processes (the same weights, tested in test_distributed).
    assert stage_params_hash(load_config(PARAMS, ["evaluate.batch_size=7"]), "grpo", "data", "model") == key
    seeded = stage_params_hash(load_config(PARAMS, ["distributed.per_group_sampling=true"]), "grpo", "d", "m")
    assert stage_params_hash(load_config(PARAMS, ["distributed.per_group_sampling=true", "distributed.nproc=2"]),
                             "grpo", "d", "m") == seeded
    assert stage_params_hash(load_config(PARAMS, ["distributed.nproc=2"]), "grpo", "d", "m") == seeded


# ------------------------------------------------------------------- 2 and 3. the prompt-once forward
def _mistral(sliding_window):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, sliding_window=sliding_window)).eval()


def test_sliding_window_shorter_than_a_row_falls_back_to_the_plain_forward():
    # Mistral's config has no use_sliding_window switch: a window of 10 on 17-token rows was accepted
    # before (log-probs 9e-2 off).
    assert checked_prefix_shared_lm(_mistral(10), VOCAB, max_length=17, completion_length=6) is None
    assert checked_prefix_shared_lm(_mistral(None), VOCAB, max_length=17, completion_length=6) is not None
    assert checked_prefix_shared_lm(_mistral(32), VOCAB, max_length=17, completion_length=6) is not None


def test_the_window_guard_does_not_rely_on_the_self_check(monkeypatch):
    """Rows longer than the self-check (capped at MAX_CHECK_LENGTH) are still refused on the config alone."""
    import components.engine.generation.fast.check as check

    monkeypatch.setattr(check, "MAX_CHECK_LENGTH", 8)  # the check's rows fit a window of 8 ...
    assert checked_prefix_shared_lm(_mistral(8), VOCAB, max_length=17, completion_length=4) is None  # ... rows don't


def test_full_attention_rules():
    class C:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    assert full_attention(C(), 100)
    assert full_attention(C(sliding_window=4096, use_sliding_window=False), 9000)  # Qwen2: switched off
    assert not full_attention(C(sliding_window=10), 17)  # Mistral: no switch
    assert full_attention(C(sliding_window=10), 10)
    assert not full_attention(C(sliding_window=8, use_sliding_window=True,
                                layer_types=["full_attention", "sliding_attention"]), 17)
    assert full_attention(C(sliding_window=8, layer_types=["full_attention", "full_attention"]), 17)


@pytest.mark.parametrize("rate", [0.1, 1e-6])
def test_attention_dropout_falls_back_to_the_plain_forward(rate):
    """Refused on the config, not left to the self-check: a rate too small for a check to notice (1e-6) would
    otherwise let a forward that applies no attention dropout train in its place."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64, attention_dropout=rate))
    assert checked_prefix_shared_lm(model, VOCAB) is None


def test_prompts_with_equal_ids_but_another_mask_are_not_merged():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64, pad_token_id=0)).eval()
    fast = checked_prefix_shared_lm(model, VOCAB)
    assert fast is not None
    # Two adjacent rows with the same ids; in the second the leading 0 is a real token, not padding.
    prompt = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 7]])
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    completion = torch.tensor([[3, 4, 5], [3, 4, 5]])
    rollout = Turn(prompt, prompt_mask, completion, torch.ones_like(completion), torch.zeros(2, dtype=torch.bool))
    ours = fast.completion_logprobs(rollout)[0]
    reference = completion_logprobs(model, rollout)[0]
    assert torch.allclose(ours, reference, atol=1e-4), (ours - reference).abs().max()
    assert not torch.allclose(ours[0], ours[1], atol=1e-3)  # the two rows really differ


# --------------------------------------------------------------------------------- 4. config rules
def test_reinforce_with_dynamic_sampling_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"grpo.dynamic_sampling.enabled: .*grpo.algorithm: reinforce"):
        load_config(PARAMS, ["grpo.algorithm=reinforce", "grpo.group_size=1", "grpo.kl_beta=0",
                             "grpo.dynamic_sampling.enabled=true"])


def test_k1_as_a_loss_term_is_refused():
    with pytest.raises(ConfigError, match=r"grpo.kl_estimator: k1 .*expected gradient is exactly zero"):
        load_config(PARAMS, ["grpo.kl_estimator=k1", "grpo.kl_beta=0.04"])
    load_config(PARAMS, ["grpo.kl_estimator=k1", "grpo.kl_beta=0"])  # no KL term: nothing to refuse


@pytest.mark.parametrize("loss_type,warned", [("dapo", True), ("bnpo", True), ("dr_grpo", True), ("grpo", False)])
def test_gspo_with_a_token_sum_loss_is_warned(loss_type, warned):
    cfg = load_config(PARAMS, ["grpo.importance_sampling_level=sequence", f"grpo.loss_type={loss_type}"])
    messages = config_warnings(cfg)
    assert bool(messages) == warned
    if warned:
        assert f"grpo.loss_type: {loss_type} is not GSPO" in messages[0]
    assert config_warnings(load_config(PARAMS, [f"grpo.loss_type={loss_type}"])) == []


# ------------------------------------------------------------------ 5. completions no reward scored
def test_unscored_completion_is_left_out_of_its_group_as_in_trl():
    adv = group_advantages(torch.tensor([1.0, 0.0, math.nan, 1.0]), 4)
    assert adv.tolist() == pytest.approx([0.57735, -1.1547, 0.0, 0.57735], abs=1e-3)  # TRL's numbers
    # A group where nothing was scored: no signal, no NaN.
    assert group_advantages(torch.tensor([math.nan] * 4), 4).tolist() == [0.0] * 4


def test_reward_result_marks_unscored_completions():
    def half(prompts, completions, **_):
        return [None if c == "x" else 1.0 for c in completions]

    result = RewardModel([type("S", (), {"name": "tests.engine.grpo.test_engine_audit:_only_y", "weight": 1.0})(),
                          type("S", (), {"name": "exact_match", "weight": 1.0})()])(
        ["p"] * 3, ["x", "y", "z"], {"answer": [None, None, "z"]})
    assert result.scorable == [False, True, True]
    assert result.advantage_rewards()[0] != result.advantage_rewards()[0]  # NaN
    assert result.advantage_rewards()[1:] == [1.0, 1.0]
    assert result.total == [0.0, 1.0, 1.0]  # logging and evaluation keep treating None as 0
    assert informative_groups([1.0, math.nan, 1.0, 1.0], 4) == []  # the scored ones agree
    assert informative_groups([1.0, math.nan, 0.0, 1.0], 4) == [0]


def _only_y(prompts, completions, **_):
    return [1.0 if c == "y" else None for c in completions]


def _tiny():
    from components.config import TinyModelConfig
    from components.engine.models.modeling import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer(["0123456789+="])
    return tok, build_tiny_model(TinyModelConfig(), tok, seed=0)


@pytest.fixture(scope="module")
def tiny_model():
    return _tiny()


def _rollout(tok, model, n_prompts=2, group=4, length=4):
    return sample_texts(model, tok, [f"{i}+{i + 3}=" for i in range(n_prompts)],
                        SamplingParams(n=group, max_new_tokens=length), torch.Generator().manual_seed(0))


def test_unscored_rows_count_in_no_normaliser(tiny_model):
    """grpo loss: a mean over the scored sequences only (dividing by all rows would shrink it)."""
    tok, model = tiny_model
    rollout = _rollout(tok, model)
    rewards = torch.tensor([1.0, 0.0, math.nan, 1.0, 0.0, 1.0, 1.0, 0.0])
    scorable = ~torch.isnan(rewards)
    adv = torch.tensor([1.0, 0.5, 0.0, 2.0, -1.0, 0.3, 1.5, 0.7])  # not centred, so the mean is far from 0
    mask = loss_mask(rollout, scorable, mask_truncated=False)
    g = GRPOConfig(group_size=4, prompts_per_step=2, kl_beta=0.0, loss_type="grpo", max_grad_norm=1e9)
    stats = policy_updates(Policy.of(tok, copy.deepcopy(model).train()), torch.optim.SGD(model.parameters(), lr=0.0),
                           Trajectory(rollout, adv, mask, scorable), g)
    keep = [0, 1, 3, 4, 5, 6, 7]
    with torch.no_grad():
        logp = completion_logprobs(model, rollout.select(keep))[0]
        expected = policy_loss(logp, logp, adv[keep], rollout.completion_mask[keep], GRPOLoss("grpo", ClipRange())).loss
    assert stats.loss == pytest.approx(float(expected), rel=1e-5)


def test_loss_mask_drops_unscored_and_truncated_rows():
    completion_mask = torch.ones(4, 3, dtype=torch.long)
    completion_mask[3, 2] = 0
    rollout = Turn(torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.long),
                       torch.zeros(4, 3, dtype=torch.long), completion_mask, torch.tensor([False, True, False, False]))
    scorable = torch.tensor([True, True, False, True])
    assert loss_mask(rollout, scorable, mask_truncated=False).tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 1, 0]]
    assert loss_mask(rollout, scorable, mask_truncated=True).tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0], [1, 1, 0]]


# --------------------------------------------------------------------------- 6. KL estimator gradients
def _expected_gradient(estimator: str) -> torch.Tensor:
    """E_{x ~ pi}[d k(x) / d theta] exactly, on a 4-way categorical pi = softmax(theta)."""
    theta = torch.tensor([0.3, -0.2, 0.5, 0.0], requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.4, -0.3, 0.1]), 0)
    logp = torch.log_softmax(theta, 0)
    per_outcome = kl_estimate(logp, ref, estimator)
    (logp.exp().detach() * per_outcome).sum().backward()  # sampling distribution held fixed, as in training
    return theta.grad


def _exact_kl_gradient(direction: str) -> torch.Tensor:
    theta = torch.tensor([0.3, -0.2, 0.5, 0.0], requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.4, -0.3, 0.1]), 0)
    logp = torch.log_softmax(theta, 0)
    kl = (logp.exp() * (logp - ref)).sum() if direction == "policy||ref" else (ref.exp() * (ref - logp)).sum()
    kl.backward()
    return theta.grad


def test_k3_gradient_is_that_of_kl_ref_to_policy():
    assert torch.allclose(_expected_gradient("k3"), _exact_kl_gradient("ref||policy"), atol=1e-6)
    assert not torch.allclose(_expected_gradient("k3"), _exact_kl_gradient("policy||ref"), atol=1e-3)


def test_k2_gradient_is_that_of_kl_policy_to_ref():
    assert torch.allclose(_expected_gradient("k2"), _exact_kl_gradient("policy||ref"), atol=1e-6)


def test_k1_expected_gradient_is_zero():
    assert torch.allclose(_expected_gradient("k1"), torch.zeros(4), atol=1e-7)
    assert _exact_kl_gradient("policy||ref").abs().max() > 1e-2  # ... while the KL it estimates has one


# ---------------------------------------------------------------------------------------- 8. bnpo
def test_bnpo_normalises_each_minibatch_by_its_own_tokens(tiny_model):
    """bnpo: mean of the minibatches' token means (TRL); dapo: the chunk's token mean. They differ once
    minibatches hold different token counts."""
    tok, model = tiny_model
    rollout = _rollout(tok, model)
    mask = rollout.completion_mask.clone()
    mask[4:, 1:] = 0  # the second minibatch keeps 1 token a row, the first all of them
    adv = torch.tensor([1.0, 2.0, 0.5, -0.5, 2.0, 1.0, 1.0, 3.0])
    losses = {}
    for loss_type in ("bnpo", "dapo"):
        g = GRPOConfig(group_size=4, prompts_per_step=2, kl_beta=0.0, loss_type=loss_type, minibatch_size=4)
        losses[loss_type] = policy_updates(Policy.of(tok, copy.deepcopy(model).train()),
                                           torch.optim.SGD(model.parameters(), lr=0.0),
                                           Trajectory(rollout, adv, mask, torch.ones(8, dtype=torch.bool)), g).loss
    with torch.no_grad():
        logp = completion_logprobs(model, rollout)[0]
        per_token = -adv[:, None] * torch.ones_like(logp)  # ratio 1: -A on every real token
        first, second = slice(0, 4), slice(4, 8)
        means = [(per_token[s] * mask[s]).sum() / mask[s].sum() for s in (first, second)]
        expected_bnpo = float(sum(means) / 2)
        expected_dapo = float((per_token * mask).sum() / mask.sum())
    assert losses["bnpo"] == pytest.approx(expected_bnpo, rel=1e-5)
    assert losses["dapo"] == pytest.approx(expected_dapo, rel=1e-5)
    assert abs(expected_bnpo - expected_dapo) > 1e-2


# ----------------------------------------------------------------------- the frozen reference is used
def test_reference_logprobs_come_from_the_frozen_reference(tiny_model):
    from components.engine.grpo.policy import build_policy  # noqa: F401 - the same Policy the trainer builds

    tok, base = tiny_model
    model = copy.deepcopy(base).train()
    reference = copy.deepcopy(base).eval().requires_grad_(False)
    fast = PrefixSharedEngine(checked_prefix_shared_lm(model, len(tok)), SpecialTokens.of(tok))
    for policy in (Policy.of(tok, model, reference=reference), Policy.of(tok, model, fast, reference=reference)):
        rollout = _rollout(tok, base)
        g = GRPOConfig(group_size=4, prompts_per_step=2, kl_beta=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        policy_updates(policy, opt, Trajectory(rollout, torch.linspace(-1, 1, len(rollout)), rollout.completion_mask,
                                               torch.ones(len(rollout), dtype=torch.bool)), g)
        with torch.no_grad():
            frozen = completion_logprobs(base, rollout)[0]
            moved = completion_logprobs(model, rollout)[0]
        real = rollout.completion_mask.bool()  # the prompt-once forward scores real tokens only (0 after EOS)
        assert not torch.allclose(frozen[real], moved[real], atol=1e-3), "the policy did not move"
        assert torch.allclose(policy.reference_logprobs(rollout)[real], frozen[real], atol=1e-4)


def test_first_pass_ratio_is_exactly_one_with_mu_2(tiny_model):
    tok, base = tiny_model
    rollout = _rollout(tok, base)
    model = copy.deepcopy(base).train()
    seen = []

    import components.engine.grpo.objectives as objectives

    original = objectives.policy_loss

    def spy(logp, old_logp, *args, **kwargs):
        out = original(logp, old_logp, *args, **kwargs)
        seen.append(float(out.ratio_mean))
        return out

    g = GRPOConfig(group_size=4, prompts_per_step=2, num_iterations=2, kl_beta=0.0, epsilon=0.01)
    policy = Policy.of(tok, model)
    plan = UpdatePlan.of(len(rollout), rollout.group_size, g)
    objectives.policy_loss = spy  # what the loss object calls
    try:
        policy_updates(policy, torch.optim.SGD(model.parameters(), lr=1.0),
                       Trajectory(rollout, torch.linspace(-1, 1, len(rollout)), rollout.completion_mask,
                                  torch.ones(len(rollout), dtype=torch.bool),
                                  old_logp=old_logprobs(policy, rollout, plan)), g)
    finally:
        objectives.policy_loss = original
    assert seen[0] == pytest.approx(1.0, abs=1e-6)
    assert abs(seen[1] - 1.0) > 1e-3


# ---------------------------------------------------- the training loop, composed by hand from its parts
@pytest.mark.parametrize("variant", ["grpo", "reinforce"])
def test_two_training_steps_equal_the_parts_composed_by_hand(tmp_path, mlflow_store, variant):
    """The stage's loop must be exactly: sample -> score -> advantages -> loss mask -> reference ->
    update -> reference update. Any changed line in it (another scaling, a dropped mask, the policy
    as reference, a skipped EMA) changes the weights below."""
    from components.data.paths import Paths
    from components.data.records import read_jsonl, reward_columns, split_path
    from components.engine.generation.rollouts import decode_completions
    from components.engine.grpo.batch import PromptSchedule
    from components.engine.grpo.policy import build_policy, update_reference
    from components.engine.models.modeling import seed_everything
    from components.engine.models.optim import cosine_learning_rate
    from components.engine.rewards.rewards import RewardModel
    from components.stages.grpo import train_grpo
    from components.stages.model import build_base_model
    from components.stages.prepare import prepare

    common = ["task.n_sft=50", "task.n_train=64", "task.n_heldout=20", "sft.enabled=false", "threads=1",
              "grpo.rewards=[{name: 'reward_fixtures:first_digit_or_none', weight: 1.0}]", "grpo.steps=2",
              "grpo.checkpoint_every=0", "grpo.max_completion_length=3", "grpo.learning_rate=0.01",
              "grpo.warmup_steps=1", "grpo.mask_truncated_completions=true", "grpo.prefix_sharing=false"]
    common += (["grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.kl_beta=0.2", "grpo.scale_rewards=batch",
                "grpo.reference.mode=ema", "grpo.reference.ema_alpha=0.5"] if variant == "grpo" else
               ["grpo.algorithm=reinforce", "grpo.group_size=1", "grpo.prompts_per_step=16", "grpo.kl_beta=0"])
    cfg = load_config(PARAMS, common)
    paths = Paths(root=tmp_path)
    prepare(cfg, paths)
    build_base_model(cfg, paths)
    from components.stages.sft import train_sft

    train_sft(cfg, paths)
    train_grpo(cfg, paths)
    from safetensors.torch import load_file

    trained = load_file(str(paths.grpo_model / "model.safetensors"))

    g = cfg.grpo
    seed_everything(cfg.seed, cfg.threads)
    records = read_jsonl(split_path(paths.data, "train"))
    policy, _ = build_policy(cfg, paths.base_model.resolve(), torch.device("cpu"), records,
                             with_reference=g.kl_beta > 0)
    optimizer = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=g.learning_rate,
                                  weight_decay=g.weight_decay, fused=True)
    schedule = PromptSchedule(len(records), g.prompts_per_step, cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    rewards = RewardModel(g.rewards, timeout_s=g.reward_timeout_s)
    params = SamplingParams(n=g.group_size, max_new_tokens=g.max_completion_length, temperature=g.temperature)
    unscored = 0
    for step in range(g.steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_learning_rate(step, g.steps, g.learning_rate, g.warmup_steps, g.min_lr_ratio)
        chosen = [records[i] for i in schedule.indices(step)]
        rollout = sample_texts(policy.model, tok := policy.tokenizer, [r["prompt"] for r in chosen], params, generator)
        reward = torch.tensor(rewards([r["prompt"] for r in chosen for _ in range(g.group_size)],
                                      decode_completions(tok, rollout),
                                      {**reward_columns(chosen, g.group_size),
                                       "completion_token_lengths": rollout.completion_lengths()}).advantage_rewards())
        scorable = ~torch.isnan(reward)
        unscored += int((~scorable).sum())
        advantages = torch.nan_to_num(reward) if variant == "reinforce" else group_advantages(reward, g.group_size,
                                                                                              "batch")
        mask = rollout.completion_mask * (scorable & ~rollout.truncated).unsqueeze(-1)
        ref = None
        if g.kl_beta > 0:
            with torch.no_grad():
                ref = completion_logprobs(policy.reference, rollout, g.temperature)[0]
        policy_updates(policy, optimizer, Trajectory(rollout, advantages, mask, scorable, ref), g)
        if g.reference.mode == "ema":
            update_reference(policy.reference, policy.model, "ema", step, 0.5, 1)
    assert unscored > 0, "the reward never returned None: the test would not cover unscored completions"
    for name, tensor in policy.model.state_dict().items():
        if name in trained:
            assert torch.equal(trained[name], tensor), name
