"""The SFT warm start stops on a measured greedy reward (sft.stop_at_reward), not on a step count."""

import json

from components.config import load_config
from components.data.paths import Paths
from components.stages.model import build_base_model
from components.stages.prepare import prepare
from components.stages.sft import train_sft

from conftest import committed_params

SMALL = ["task.n_sft=256", "task.n_train=64", "task.n_heldout=20", "sft.epochs=3", "sft.batch_size=32",
         "sft.check_every=4", "sft.check_prompts=16", "threads=1"]


def _train(tmp_path, reward, target, extra=()):
    reward_set = f"grpo.rewards=[{{name: 'reward_fixtures:{reward}', weight: 1.0}}]"
    cfg = load_config(committed_params(), SMALL + [reward_set, f"sft.stop_at_reward={target}", *extra])
    paths = Paths(root=tmp_path)
    prepare(cfg, paths)
    build_base_model(cfg, paths)
    summary = train_sft(cfg, paths)
    assert json.loads((paths.metrics / "sft.json").read_text()) == summary
    return summary


def test_sft_stops_at_the_first_check_that_reaches_the_target(tmp_path, mlflow_store, capsys):
    summary = _train(tmp_path, "always_one", 0.5)
    assert summary["steps"] == 4 and summary["stopped_early"] is True and summary["check_reward"] == 1.0
    assert "sft: stopped at step 4/24" in capsys.readouterr().out


def test_sft_that_never_reaches_the_target_trains_every_epoch_and_says_so(tmp_path, mlflow_store, capsys):
    summary = _train(tmp_path, "always_zero", 0.5)
    assert summary["steps"] == 24 and summary["stopped_early"] is False and summary["check_reward"] == 0.0
    assert "below sft.stop_at_reward 0.5: the warm start is weaker than intended" in capsys.readouterr().out


def test_a_target_first_reached_by_the_last_weights_is_no_warning(tmp_path, mlflow_store, capsys):
    """No check fell inside training (sft.check_every past its steps): the last weights' check reaches the target,
    so nothing warns that the warm start is weak."""
    summary = _train(tmp_path, "always_one", 0.5, ["sft.check_every=100"])
    assert summary["steps"] == 24 and summary["stopped_early"] is False and summary["check_reward"] == 1.0
    assert "warm start is weaker" not in capsys.readouterr().out


def test_without_a_target_sft_trains_every_epoch(tmp_path, mlflow_store):
    summary = _train(tmp_path, "always_one", "null")
    assert summary["steps"] == 24 and "stopped_early" not in summary


def test_sft_learns_the_target_column_after_the_prompt_and_nothing_else():
    from components.stages.sft import encode_sft

    class Chars:  # one id per character, EOS = 0, pad = 0
        eos_token_id, pad_token_id = 0, 0

        def __call__(self, text, add_special_tokens=False):
            return type("Encoded", (), {"input_ids": [ord(c) for c in text]})()

    records = [{"prompt": "Q1 ", "answer": "7", "solution": "3+4=7"},
               {"prompt": "Q22 ", "answer": "9", "solution": "9"}]
    ids, mask, labels = encode_sft(Chars(), records, target="solution")
    assert ids[0, :9].tolist() == [ord(c) for c in "Q1 3+4=7"] + [0] and mask.sum(1).tolist() == [9, 6]
    assert labels[0].tolist() == [-100] * 3 + [ord(c) for c in "3+4=7"] + [0]  # the solution and EOS, no prompt
    assert labels[1].tolist() == [-100] * 4 + [ord("9"), 0] + [-100] * 3       # padding ignored
    assert encode_sft(Chars(), records)[2][0].tolist()[3:5] == [ord("7"), 0]  # default: the answer


def test_the_loss_through_either_engine_equals_the_full_width_cross_entropy():
    """SFT's loss goes through the engine door (`batch_loss`): the plain engine and the prompt-once one (which encodes
    the prefix the rows share once and feeds no padding) give the full-width next-token cross-entropy of the learned
    tokens and its gradients (float32): rows right-padded, answers starting at other columns, a worked conversation
    whose middle (a tool's answer) is context but not learned, and a row learned from column 1."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from components.engine.generation.engines.base import SpecialTokens
    from components.engine.generation.engines.choose import plain_engine
    from components.engine.generation.engines.prefix_shared import PrefixSharedEngine
    from components.engine.generation.fast.fastlm import PrefixSharedLM
    from components.engine.generation.rollouts import positions_from_mask
    from components.engine.parallel.distributed import DistContext
    from components.stages.sft import batch_loss

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    ids = torch.randint(1, 50, (4, 24))
    ids[:, :10] = ids[0, :10]  # a shared system prompt: the prompt-once engine encodes it once
    mask = torch.ones_like(ids)
    mask[1, 19:] = 0  # right padding
    mask[3, 15:] = 0
    labels = torch.full_like(ids, -100)
    labels[0, 12:] = ids[0, 12:]
    labels[1, 14:19] = ids[1, 14:19]
    labels[2, 11:15] = ids[2, 11:15]  # a model turn, a tool's answer (columns 15..17, context only), a model turn
    labels[2, 18:] = ids[2, 18:]
    labels[3, 1:15] = ids[3, 1:15]  # everything after the first token

    def grads() -> list[torch.Tensor]:
        out = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return out

    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
    expected.backward()
    expected_grads = grads()
    tokens = SpecialTokens(0, 0)
    for engine in (plain_engine(model, tokens), PrefixSharedEngine(PrefixSharedLM(model), tokens)):
        loss, value = batch_loss(engine, ids, mask, labels, torch.arange(4), 0, DistContext())
        loss.backward()
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=0, atol=1e-6)
        assert value == loss.item()
        for got, want in zip(grads(), expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
