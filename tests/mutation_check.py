"""Hand-written mutations of the GRPO maths, each of which the engine tests must catch.

    python tests/mutation_check.py            # prints a table (its time: benchmarks/results/mutation_check.md)
    python tests/mutation_check.py -k kl      # only mutations whose name contains "kl"

Each mutation replaces one line (a flipped sign, a dropped term, the policy where the frozen reference
belongs, a removed mask) in a copy of the source, runs the engine tests against it, and records the
first test that failed. A mutation no test catches is printed as SURVIVED and the script exits 1; so does
one whose original text is not exactly once in its file (checked before anything runs, and by
tests/test_mutation_check.py in the suite).
Not collected by pytest (not named test_*); the source files are restored whatever happens.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "mutation_check.md"
TESTS = ["tests/engine/grpo/test_objectives.py", "tests/engine/grpo/test_engine_variants.py",
         "tests/engine/grpo/test_engine_audit.py", "tests/engine/generation/engines/test_engines.py",
         "tests/engine/generation/fast/test_fastlm.py", "tests/engine/generation/fast/test_check.py",
         "tests/engine/generation/fast/test_matmul.py", "tests/engine/generation/fast/test_head.py",
         "tests/engine/generation/fast/test_rmsnorm.py",
         "tests/stages/test_sft.py"]
# The newer variants' tests, run first for their own mutations (the TRL reference takes ~10 s to import, so the
# other mutations do not pay for it unless everything else passed).
VARIANT_TESTS = ["tests/engine/grpo/test_against_trl.py", "tests/engine/grpo/test_variants_in_the_update.py",
                 "tests/engine/rewards/test_rewards_builtin.py", "tests/engine/evaluation/test_monitors.py",
                 "tests/engine/generation/engines/test_draw.py",
                 "tests/engine/generation/environments/test_episodes.py", "tests/engine/generation/test_service.py"]
VARIANT_PREFIXES = ("cispo:", "sapo:", "gdpo:", "entropy mask:", "on-policy gap:", "diversity:", "episode:")
# The engine table's test (a copy of the project with an engine added), run first for the engine door's mutations.
ENGINE_TESTS, ENGINE_PREFIXES = ["tests/engine/generation/engines/test_engine_entries.py"], ("engines:",)

# (name, file, original text, mutated text): the original must occur exactly once.
MUTATIONS: list[tuple[str, str, str, str]] = [
    # advantages
    ("advantage: no centring", "components/engine/grpo/objectives.py",
     "centred = grouped - grouped.mean(dim=1, keepdim=True)", "centred = grouped"),
    ("advantage: sign flipped", "components/engine/grpo/objectives.py",
     "centred = grouped - grouped.mean(dim=1, keepdim=True)", "centred = grouped.mean(dim=1, keepdim=True) - grouped"),
    ("advantage: group std dropped", "components/engine/grpo/objectives.py",
     "centred = centred / (grouped.std(dim=1, keepdim=True) + eps)", "centred = centred"),
    ("advantage: biased std", "components/engine/grpo/objectives.py",
     "centred = centred / (grouped.std(dim=1, keepdim=True) + eps)",
     "centred = centred / (grouped.std(dim=1, keepdim=True, unbiased=False) + eps)"),
    ("advantage: batch std dropped", "components/engine/grpo/objectives.py",
     "centred = centred / (rewards.std() + eps)", "centred = centred"),
    ("advantage: unscored completions get a nonzero advantage", "components/engine/grpo/objectives.py",
     "return torch.nan_to_num(centred.reshape(-1), nan=0.0)",
     "return torch.nan_to_num(centred.reshape(-1), nan=1.0)"),
    ("advantage: unscored mean not nan-aware", "components/engine/grpo/objectives.py",
     "centred = grouped - grouped.nanmean(dim=1, keepdim=True)",
     "centred = grouped - torch.nan_to_num(grouped).mean(dim=1, keepdim=True)"),
    # KL
    ("kl: k3 sign of log r flipped", "components/engine/grpo/objectives.py",
     "return torch.exp(log_r) - 1.0 - log_r", "return torch.exp(log_r) - 1.0 + log_r"),
    ("kl: k3 loses its -1", "components/engine/grpo/objectives.py",
     "return torch.exp(log_r) - 1.0 - log_r", "return torch.exp(log_r) - log_r"),
    ("kl: k2 loses its square", "components/engine/grpo/objectives.py",
     "return 0.5 * log_r.pow(2)", "return 0.5 * log_r"),
    ("kl: log ratio reversed", "components/engine/grpo/objectives.py",
     "log_r = ref_logp - logp", "log_r = logp - ref_logp"),
    ("kl: term dropped from the loss", "components/engine/grpo/objectives.py",
     "total = pg_loss + beta * kl",
     "total = pg_loss"),
    ("kl: beta sign flipped", "components/engine/grpo/objectives.py",
     "total = pg_loss + beta * kl",
     "total = pg_loss - beta * kl"),
    # ratio and clipping
    ("ratio: inverted", "components/engine/grpo/objectives.py",
     "log_ratio = logp - old_logp", "log_ratio = old_logp - logp"),
    ("ratio: sequence mean unmasked", "components/engine/grpo/objectives.py",
     "log_ratio = ((log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)).unsqueeze(-1)",
     "log_ratio = log_ratio.mean(-1, keepdim=True)"),
    ("clip: lower bound uses epsilon_high", "components/losses.py",
     "clipped = ratio.clamp(1.0 - low, 1.0 + high)",
     "clipped = ratio.clamp(1.0 - high, 1.0 + high)"),
    ("clip: min becomes max", "components/losses.py",
     "return -(ratio * adv).minimum(clipped * adv)",
     "return -(ratio * adv).maximum(clipped * adv)"),
    ("clip: unclipped surrogate", "components/losses.py",
     "return -(ratio * adv).minimum(clipped * adv)",
     "return -(ratio * adv)"),
    ("clip stats: low side swapped", "components/losses.py",
     "low = ((ratio < 1.0 - epsilon_low) & (adv < 0)).to(ratio.dtype)",
     "low = ((ratio < 1.0 - epsilon_low) & (adv > 0)).to(ratio.dtype)"),
    # aggregation and masks
    ("aggregate: grpo per-sequence mean unmasked", "components/losses.py",
     "per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)",
     "per_seq = per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)"),
    ("aggregate: grpo divides by the longest row", "components/losses.py",
     "per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)",
     "per_seq = (per_token * mask).sum(-1) / per_token.shape[-1]"),
    ("aggregate: dapo ignores the global token count", "components/losses.py",
     "tokens = mask.sum().clamp(min=1.0) if n.num_tokens is None else max(n.num_tokens, 1.0)",
     "tokens = mask.sum().clamp(min=1.0)"),
    ("aggregate: dr_grpo ignores max length", "components/losses.py",
     "return (per_token * mask).sum() / (sequences * n.max_completion_length)",
     "return (per_token * mask).sum() / sequences"),
    ("mask: truncated completions kept", "components/engine/grpo/trajectory.py",
     "keep = keep & ~rollouts.truncated",
     "keep = keep"),
    ("mask: unscored completions kept", "components/engine/grpo/trajectory.py",
     "    keep = scorable\n", "    keep = torch.ones_like(scorable)\n"),
    ("defect 5: unscored rows counted in the grpo normaliser", "components/engine/grpo/trajectory.py",
     "return float(self.scorable.sum())",
     "return float(len(self))"),
    ("defect 8: bnpo computed like dapo", "components/engine/grpo/objectives.py",
     "return minibatch_tokens if LOSSES[self.loss_type].per_minibatch else step_tokens",
     "return step_tokens"),
    ("bnpo: minibatch means summed, not averaged", "components/engine/grpo/objectives.py",
     "return 1.0 / minibatches if LOSSES[self.loss_type].per_minibatch else 1.0",
     "return 1.0"),
    # the training loop (tests/engine/grpo/test_engine_audit.py composes the same step by hand)
    ('loop: scale_rewards ignored', 'components/engine/grpo/objectives.py',
     'return group_advantages(rewards, group_size, self.scale_rewards)',
     'return group_advantages(rewards, group_size, "group")'),
    ("loop: unscored completions treated as scored", "components/engine/grpo/trajectory.py",
     "scorable = ~torch.isnan(rewards)", "scorable = torch.ones_like(rewards, dtype=torch.bool)"),
    # (their advantage's value is never used: loss_mask drops their tokens; a NaN would poison the loss)
    ("loop: reinforce passes unscored NaN rewards on as advantages", "components/engine/grpo/objectives.py",
     "return torch.nan_to_num(rewards, nan=0.0)", "return rewards"),
    ("loop: mask_truncated_completions ignored", "components/engine/grpo/trajectory.py",
     "loss_mask(rollouts, scorable, mask_truncated), scorable, ref_logp, old_logp)",
     "loss_mask(rollouts, scorable, False), scorable, ref_logp, old_logp)"),
    ("loop: policy used as the reference", "components/engine/grpo/update.py",
     "return logprobs_of_rows(lambda rows: policy.reference_logprobs(rows), rollouts, [plan.my_rows],",
     "return logprobs_of_rows(lambda rows: policy.logprobs(rows)[0].detach(), rollouts, [plan.my_rows],"),
    ("loop: reference never updated", "components/stages/grpo.py",
     "if t.moving_reference:",
     "if False:"),
    ("loop: KL term never computed", "components/stages/grpo.py",
     "if loss.uses_reference and len(rollouts) else None",
     "if False else None"),
    # old log-probs and reference
    ("mu: old log-probs are the current ones", "components/engine/grpo/update.py",
     "old_logp = part.old_logp if part.old_logp is not None else logp.detach()",
     "old_logp = logp.detach()"),
    ("reference: policy used (plain forward)", "components/engine/grpo/policy.py",
     "reference_engine = engine.over(reference)",
     "reference_engine = engine"),
    ("reference: policy used (prompt-once forward)", "components/engine/generation/engines/prefix_shared.py",
     "return PrefixSharedEngine(self.lm.over(model), self.tokens)",
     "return self"),
    ("reference: ema weights swapped", "components/engine/grpo/policy.py",
     "r.mul_(1.0 - ema_alpha).add_(p.detach(), alpha=ema_alpha)",
     "r.mul_(ema_alpha).add_(p.detach(), alpha=1.0 - ema_alpha)"),
    ("reference: periodic sync off by one", "components/engine/grpo/policy.py",
     "if mode == \"periodic\" and (step + 1) % sync_every == 0:",
     "if mode == \"periodic\" and step % sync_every == 0:"),
    # each audit defect as it was before its fix: the test named in the table failed on it
    ("defect 1: resume key from the grpo section only", "components/config/hashing.py",
     "return section_hash({key: trained_value(cfg, key) for key in STAGE_PARAMS[stage]}, *inputs)",
     "return section_hash(cfg.grpo, cfg.seed, *inputs)"),
    ("defect 5: unscored completions scored 0, as before", "components/engine/grpo/objectives.py",
     "        return scores.advantage_rewards()",
     "        return scores.total"),
    ("defect 4: reinforce with dynamic sampling accepted", "components/config/grpo.py",
     '_require(not (g.dynamic_sampling.enabled and g.algorithm == "reinforce"), "grpo.dynamic_sampling.enabled",',
     '_require(True, "grpo.dynamic_sampling.enabled",'),
    ("defect 6: k1 accepted as a loss term", "components/config/grpo.py",
'_require(not (g.kl_beta > 0 and g.kl_estimator == "k1"), "grpo.kl_estimator",',
     '_require(True, "grpo.kl_estimator",'),
    ("defect 7: GSPO with a token-sum loss not warned", "components/config/pipeline.py",
     'if g.importance_sampling_level == "sequence" and not loss.per_sequence:', "if False:"),
    # the warm start's stop rule (the robust default rests on it)
    ("sft: stop rule ignored", "components/stages/sft.py",
     "if check_reward >= s.stop_at_reward:", "if False:"),
    ("sft: check never run", "components/stages/sft.py",
     "if check is not None and step % s.check_every == 0:", "if False:"),
    ("sft: the first learned token taken into the prompt", "components/stages/sft.py",
     "first = int(targets[0]) + 1 if len(targets)", "first = int(targets[0]) + 2 if len(targets)"),
    ("sft: a worked conversation's tool answers learned too", "components/stages/sft.py",
     "learned = batch.written", "learned = batch.completion_mask"),
    # prompt-once forward
    ("defect 3: fastlm groups prompts by ids alone", "components/engine/generation/fast/fastlm.py",
     "keyed = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)",
     "keyed = torch.cat([prompt_ids, 0 * prompt_mask.to(prompt_ids.dtype)], dim=1)"),
    ("defect 2: fastlm ignores sliding windows", "components/engine/generation/fast/build.py",
     'if not full_attention(config, longest) or float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:',
     'if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:'),
    ("defect 3: fastlm ignores attention dropout", "components/engine/generation/fast/build.py",
     'if not full_attention(config, longest) or float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:',
     "if not full_attention(config, longest):"),
    ("fastlm: short softmax rows padded with zeros, not -inf", "components/engine/generation/fast/pieces.py",
     'value=float("-inf"))', "value=0.0)"),
    ("fastlm: the first token predicted from each prompt's first position",
     "components/engine/generation/fast/fastlm.py",
     "torch.cat([x[0, w - 1:u * w:w], x[0, u * w:]])", "torch.cat([x[0, 0:u * w:w], x[0, u * w:]])"),
    ("fastlm: packed tokens unpacked into the wrong slots", "components/engine/generation/fast/attention.py",
     "source[slots] = torch.arange(len(fed_rows), device=device)[tokens]",
     "source[slots] = torch.arange(len(fed_rows), device=device)[tokens].flip(0)"),
    ("fastlm: a completion row's token sees the next one", "components/engine/generation/fast/attention.py",
     "causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()",
     "causal = torch.ones(width, width, dtype=torch.bool, device=device).tril(1)"),
    ("fastlm: a bucket's rows attend to other prompts", "components/engine/generation/fast/attention.py",
     "prompt_of = rows.index_select(0, b.rows)", "prompt_of = rows.index_select(0, b.rows).flip(0)"),
    ("fastlm: length buckets cut where they pad most", "components/engine/generation/fast/attention.py",
     "best, start = total.min(0)", "best, start = total.max(0)"),
    ("gemma: the attention output added to the residual before its norm", "components/engine/generation/fast/pieces.py",
     "x = x + (self.norm(layer.post_attention_layernorm, out) if sandwich else out)", "x = x + out"),
    ("gemma: attention scores not soft-capped", "components/engine/generation/fast/pieces.py",
     "        if self.attention_softcap:", "        if False:"),
    ("gemma: logits not soft-capped", "components/engine/generation/fast/pieces.py",
     "return torch.tanh(out / self.final_softcap) * self.final_softcap if self.final_softcap else out",
     "return out"),
    ("gemma: every layer rotated with the global table", "components/engine/generation/fast/layers.py",
     "return self.tables[layer.self_attn.layer_type]", 'return self.tables["full_attention"]'),
    ("gemma: the captured step rotates every layer with one attention type's table",
     "components/engine/generation/engines/static_cache.py",
     "rotary = tables[None] if None in tables else LayerTypeRotary(tables)", "rotary = next(iter(tables.values()))"),
    ("fastlm self-check: group rows never checked", "components/engine/generation/fast/check.py",
     'both: tuple[Literal["group", "completion"], ...] = ("group", "completion")',
     'both: tuple[Literal["group", "completion"], ...] = ("completion", "completion")'),
    ("fastlm self-check: no row as long as the engine's", "components/engine/generation/fast/check.py",
     'plan.append((rows_0_1, ("completion",)))', "pass"),
    ("fastlm self-check: only the first and last layers, not every kind", "components/engine/generation/fast/check.py",
     "if index in (0, len(layers) - 1) or kind not in kinds:", "if index in (0, len(layers) - 1):"),
    ("fastlm: group rows fill the grid in the wrong slots", "components/engine/generation/fast/attention.py",
     "source[slot] = torch.arange(len(slot), device=device)",
     "source[slot] = torch.arange(len(slot), device=device).flip(0)"),
    ("fastlm: group rows let prompt tokens see the left padding", "components/engine/generation/fast/attention.py",
     "owner[:, :w] = torch.where(real, -1, -3)", "owner[:, :w] = torch.where(real, -1, -1)"),
    ("fastlm: group rows let completion tokens see their own later tokens",
     "components/engine/generation/fast/attention.py",
     "order.view(-1)[slot[u * w:]] = w + fed_cols", "order.view(-1)[slot[u * w:]] = w"),
    ("fastlm: attention scores not scaled by 1/sqrt(d)", "components/engine/generation/fast/pieces.py",
     "torch.add(bias, scores, alpha=self.scaling)",
     "torch.add(bias, scores)"),
    ("fastlm: decoding's attention scores not scaled by 1/sqrt(d)", "components/engine/generation/fast/pieces.py",
     "(qg * keys).sum(-1).unsqueeze(-2), alpha=self.scaling)",
     "(qg * keys).sum(-1).unsqueeze(-2))"),
    ("matmul: oneDNN's weight gradient a mean over rows, not a sum", "components/engine/generation/fast/matmul.py",
     "grad_weight = onednn_product(grad_padded.t(), padded.t())",
     "grad_weight = onednn_product(grad_padded.t(), padded.t()) / len(rows)"),
    ("matmul: padded rows kept in the output", "components/engine/generation/fast/matmul.py",
     "return onednn_product(padded, weight, bias)[:len(flat)].view(",
     "return onednn_product(padded, weight, bias)[-len(flat):].view("),
    ("matmul: rows not padded to a few shapes", "components/engine/generation/fast/matmul.py",
     "    return -(-rows // step) * step", "    return rows"),
    ("head: the chosen token's share left out of the gradient", "components/engine/generation/fast/head.py",
     "        grad[:rows].scatter_add_(-1, tokens.unsqueeze(-1), grad_logp.unsqueeze(-1))\n", ""),
    ("head: backward allocates the softmax beside the log-softmax", "components/engine/generation/fast/head.py",
     "grad = buffer.exp_()", "grad = buffer.exp()"),
    ("fastlm: tokens past the completion mask count in telling rows apart", "components/engine/generation/fast/rows.py",
     "scored = torch.where(completion_mask.bool(), completion_ids, -1)", "scored = completion_ids"),
    ("fastlm: the prompt mask left out of telling rows apart", "components/engine/generation/fast/rows.py",
     "key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype), scored.to(prompt_ids.dtype)], dim=1)",
     "key = torch.cat([prompt_ids, scored.to(prompt_ids.dtype)], dim=1)"),
    ("fastlm: distinct rows in torch.unique's order, not row order", "components/engine/generation/fast/rows.py",
     "    return first[order], rank[inverse]", "    return first, inverse"),
    ("fastlm: repeated rows shared while dropout is active", "components/engine/generation/fast/fastlm.py",
     "return self.model.training and any(m.p > 0 and m.training for m in self.pieces.dropouts)",
     "return False"),
    ("fastlm: a repeated row's gradient shared out among its copies, not summed",
     "components/engine/generation/fast/fastlm.py",
     "        return logp.index_select(0, inverse), None if entropy is None else entropy.index_select(0, inverse)",
     "        return logp.detach().index_select(0, inverse) + (logp - logp.detach()).index_select(0, inverse) "
     "/ torch.bincount(inverse)[inverse, None], None if entropy is None else entropy.index_select(0, inverse)"),
    ("rmsnorm: backward without the normalisation's own term", "components/engine/generation/fast/rmsnorm.py",
     "grad_x = (g - x_hat * (g * x_hat).mean(-1, keepdim=True)).mul_(rstd)", "grad_x = g.mul(rstd)"),
    # CISPO, SAPO, GDPO, entropy masking, the on-policy check, the diversity reward
    ("cispo: the capped weight not detached", "components/losses.py",
     "return -ratio.clamp(max=s.cispo_max_ratio).detach() * adv * logp",
     "return -ratio.clamp(max=s.cispo_max_ratio) * adv * logp"),
    ("cispo: the weight not capped", "components/losses.py",
     "return -ratio.clamp(max=s.cispo_max_ratio).detach() * adv * logp",
     "return -ratio.detach() * adv * logp"),
    ('cispo: aggregated per sequence, not per token', 'components/losses.py',
     '    Loss("cispo", capped_weight, token_mean,',
     '    Loss("cispo", capped_weight, sequence_mean,'),
    ('sapo: aggregated per token, not per sequence', 'components/losses.py',
     '    Loss("sapo", soft_gate, sequence_mean,',
     '    Loss("sapo", soft_gate, token_mean,'),
    ("sapo: temperatures swapped", "components/losses.py",
     "tau = adv.new_full(adv.shape, s.sapo_temperature_pos).where(adv > 0, s.sapo_temperature_neg)",
     "tau = adv.new_full(adv.shape, s.sapo_temperature_neg).where(adv > 0, s.sapo_temperature_pos)"),
    ("sapo: the gate without its 4 / tau", "components/losses.py",
     "return -(tau * (ratio - 1.0)).sigmoid() * (4.0 / tau) * adv",
     "return -(tau * (ratio - 1.0)).sigmoid() * adv"),
    ("gdpo: rewards not centred in their group", "components/engine/grpo/objectives.py",
     "normalised = ((grouped - mean) / (std + eps)).view(-1, scores.shape[-1])",
     "normalised = (grouped / (std + eps)).view(-1, scores.shape[-1])"),
    ("gdpo: rewards not scaled in their group", "components/engine/grpo/objectives.py",
     "normalised = ((grouped - mean) / (std + eps)).view(-1, scores.shape[-1])",
     "normalised = (grouped - mean).view(-1, scores.shape[-1])"),
    ("gdpo: weights ignored", "components/engine/grpo/objectives.py",
     "total = (normalised * weights.to(scores.dtype)).nansum(dim=1)", "total = normalised.nansum(dim=1)"),
    ("gdpo: a row no reward scored gets a share", "components/engine/grpo/objectives.py",
     'return total.masked_fill(torch.isnan(scores).all(dim=1), float("nan"))', "return total"),
    ("gdpo: sums not scaled by the batch std", "components/engine/grpo/objectives.py",
     "centred = (rewards - rewards.nanmean()) / (_nanstd(rewards) + eps)", "centred = rewards - rewards.nanmean()"),
    ("gdpo: sums formed group-relative again", "components/engine/grpo/objectives.py",
     "            return batch_advantages(rewards)",
     "            return group_advantages(rewards, group_size, self.scale_rewards)"),
    ('gdpo: the sampler sums before normalising', 'components/engine/grpo/objectives.py',
     'if self.multi_objective == "sum_then_normalize":',
     'if True:'),
    ("entropy mask: the bottom quantile kept", "components/engine/grpo/objectives.py",
     "threshold = torch.quantile(values, 1.0 - quantile)", "threshold = torch.quantile(values, quantile)"),
    ("entropy mask: padding kept", "components/engine/grpo/objectives.py",
     "return (entropy.detach() >= threshold) & real", "return entropy.detach() >= threshold"),
    ("entropy mask: ignored by the loss", "components/engine/grpo/objectives.py",
     "pg_per_token = pg_per_token * token_mask.to(logp.dtype)", "pg_per_token = pg_per_token"),
    ("entropy mask: never passed by the update", "components/engine/grpo/update.py",
     "num_tokens=num_tokens, token_mask=token_mask)", "num_tokens=num_tokens)"),
    ("on-policy gap: the sampler's log-prob from the filtered distribution",
     "components/engine/generation/engines/draw.py",
     "if filtered is scaled:  # no filter",
     "if True:  # no filter"),
    ("on-policy gap: the sampler's log-prob without the temperature", "components/engine/generation/engines/draw.py",
     "return drawn, scaled.gather(-1, drawn[:, None]).squeeze(-1) - torch.logsumexp(scaled, -1)",
     "return drawn, torch.log_softmax(logits.float(), -1).gather(-1, drawn[:, None]).squeeze(-1)"),
    ("on-policy gap: not measured with mu > 1", "components/engine/grpo/update.py",
     "        record_gap(stats, trajectory.old_logp, trajectory.rollouts, plan.my_rows)",
     "        pass"),
    ("on-policy gap: padding counted", "components/engine/grpo/update.py",
     "sampled, mask = rollouts.sampling_logp, rollouts.written",
     "sampled, mask = rollouts.sampling_logp, torch.ones_like(rollouts.completion_mask, dtype=torch.bool)"),
    ("on-policy gap: the monitor never sees it", "components/engine/evaluation/monitors.py",
     'judged["logprob_gap"] = history[end - 1]["logprob_gap_mean"]', "pass"),
    ("diversity: shared n-grams counted as the completion's own", "components/engine/rewards/rewards.py",
     "scores[i] = sum(counts[gram] == 1 for gram in grams[i]) / len(grams[i]) if grams[i] else 0.0",
     "scores[i] = sum(counts[gram] >= 1 for gram in grams[i]) / len(grams[i]) if grams[i] else 0.0"),
    ("diversity: groups not by prompt", "components/engine/rewards/rewards.py",
     "groups.setdefault(key, []).append(i)", 'groups.setdefault("all", []).append(i)'),
    ("diversity: sampled groups ignored", "components/engine/rewards/rewards.py",
     "keys = list(group_index) if group_index is not None else list(prompts)", "keys = list(prompts)"),
    ("on-policy gap: the float32 threshold kept in bfloat16", "components/engine/evaluation/monitors.py",
     "    if dtype == torch.float32:\n        return m, None", "    if True:\n        return m, None"),
    # the three an independent read found uncaught
    ("cispo: a capped weight counted where the advantage is negative", "components/losses.py",
     "high = ((ratio > s.cispo_max_ratio) & (adv > 0)).to(ratio.dtype)",
     "high = ((ratio > s.cispo_max_ratio) & (adv < 0)).to(ratio.dtype)"),
    ("entropy mask: entropies taken in the first pass only", "components/engine/grpo/update.py",
     "with_entropy=first_pass or loss_fn.masks_by_entropy)", "with_entropy=first_pass)"),
    ("entropy mask: the quantile over every completion token, not the loss's", "components/engine/grpo/update.py",
     "token_mask = high_entropy_mask(entropy, part.loss_mask, loss_fn.top_entropy_quantile)",
     "token_mask = high_entropy_mask(entropy, part.rollouts.completion_mask, loss_fn.top_entropy_quantile)"),
    ("on-policy gap: a rollout without sampler log-probs concatenated silently",
     "components/engine/generation/rollouts.py",
     "    if any(sampled) and not all(sampled):",
     "    if False:"),
    # a loss's own settings: from the config to its entry, under their rules
    ("cispo: the entry's settings record left at its defaults, not read from the config", "components/losses.py",
     "return read_record(self.settings, config)",
     "return self.settings()"),
    ("cispo: a loss setting's rule never applied", "components/config/grpo.py",
     '_require(valid(getattr(g, key)), f"grpo.{key}", rule)', '_require(True, f"grpo.{key}", rule)'),
    ("episode: the run's temperature not read into its policy (scored at 1.0)", "components/engine/grpo/policy.py",
     "generation=Generation(engine, play, tokenizer), temperature=g.temperature)",
     "generation=Generation(engine, play, tokenizer))"),
    # an engine's own settings: from the config to its entry, the door trying every entry
    ("engines: the run's engine settings ignored, each entry at its defaults",
     "components/engine/generation/engines/choose.py",
     "settings = engine_settings() | dict(settings or {})", "settings = engine_settings()"),
    ("engines: the door tries only the built-in entries", "components/engine/generation/engines/choose.py",
     "for entry in reversed(ENGINES.values()):", "for entry in reversed(list(ENGINES.values())[:3]):"),
    # episodes: the loss sees only the model's tokens
    ("episode: tool tokens counted as the model's", "components/engine/generation/rollouts.py",
     "return real if self.model_mask is None else real & self.model_mask.bool()", "return real"),
    ("episode: the environment's answer marked as written by the model",
     "components/engine/generation/environments/episodes.py",
     "row.model + [0] * len(answer)", "row.model + [1] * len(answer)"),
    ("episode: the rollouts' model-token mask from every token", "components/engine/generation/service.py",
     "grid(lambda e: e.model_mask, 0, torch.long)", "grid(lambda e: [1] * len(e.ids), 0, torch.long)"),
    ("episode: completion_length counts the answers too", "components/engine/generation/rollouts.py",
     "return sum(self.model_mask)", "return len(self.ids)"),
    ("episode: a cut episode left unscored", "components/engine/generation/environments/episodes.py",
     "row.reward = play.limits.cut_reward if asked is None else asked", "row.reward = asked"),
    # the appended cache: a later turn continues each row's context, never re-reads it
    ("episode: the turn's last drawn token not appended", "components/engine/generation/engines/turns.py",
     "fed = last.completion_ids.shape[1] - 1", "fed = last.completion_ids.shape[1]"),
    ("episode: an answer's positions restart at 0 (prompt-once)", "components/engine/generation/fast/decoder.py",
     "rotary = pieces.positions(x, real.sum(-1, keepdim=True) + positions_from_mask(mask))",
     "rotary = pieces.positions(x, positions_from_mask(mask))"),
    ("episode: a finished row's padding visible in later turns (prompt-once)",
     "components/engine/generation/fast/decoder.py",
     ".index_fill_(0, self.open, True))", ".fill_(True))"),
    ("episode: a finished row's padding visible in later turns (plain)", "components/engine/generation/engines/hf.py",
     "device=drawn.device).index_fill_(0, self.open, True))", "device=drawn.device).fill_(True))"),
    ("episode: a finished row's padding visible in later turns (fixed-shape)",
     "components/engine/generation/engines/static_cache.py",
     "real[:, self.turn_start:] = turn[None, :] < fed[:, None]", "real[:, self.turn_start:] = True"),
    ("episode: the loss mask from every completion token", "components/engine/grpo/trajectory.py",
     "return rollouts.written.to(dtype) * keep.unsqueeze(-1).to(dtype)",
     "return rollouts.completion_mask.to(dtype) * keep.unsqueeze(-1).to(dtype)"),
]


def run_mutation(name: str, rel: str, old: str, new: str) -> tuple[str, float]:
    path = ROOT / rel
    source = path.read_text()
    if source.count(old) != 1:
        return f"NOT APPLIED ({source.count(old)} matches)", 0.0
    path.write_text(source.replace(old, new))
    started = time.perf_counter()
    try:
        tests = (VARIANT_TESTS if name.startswith(VARIANT_PREFIXES) else []) + (
            ENGINE_TESTS if name.startswith(ENGINE_PREFIXES) else []) + TESTS
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=ROOT, capture_output=True, text=True, timeout=1800)
    finally:
        path.write_text(source)
    seconds = time.perf_counter() - started
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    if proc.returncode == 0:
        return "SURVIVED", seconds
    return (failed[0] if failed else f"error (exit {proc.returncode})"), seconds


def unmatched(mutations: list[tuple[str, str, str, str]]) -> list[str]:
    """The mutations whose original text does not occur exactly once in its file (the code moved on)."""
    return [f"{name}: {rel} has {count} matches" for name, rel, old, _ in mutations
            if (count := (ROOT / rel).read_text().count(old) if (ROOT / rel).exists() else 0) != 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", default="", help="only mutations whose name contains this")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.k in m[0]]
    stale = unmatched(chosen)
    if stale:  # before any test runs: a pattern that applies nowhere checks nothing
        print("mutations that apply nowhere (update them to the code):\n  " + "\n  ".join(stale))
        return 1
    rows, survived, started = [], 0, time.perf_counter()
    for i, (name, rel, old, new) in enumerate(chosen, 1):
        caught, seconds = run_mutation(name, rel, old, new)
        survived += caught == "SURVIVED" or caught.startswith("NOT APPLIED")
        rows.append(f"| {name} | `{rel}` | {caught} |")
        print(f"[{i}/{len(chosen)}] {name}: {caught} ({seconds:.0f}s)", flush=True)
    table = "| mutation | file | first test that failed |\n|---|---|---|\n" + "\n".join(rows)
    print("\n" + table)
    if not args.k:  # a whole run: its record, with the count it produced
        minutes = (time.perf_counter() - started) / 60
        RESULTS.write_text(
            "# Mutations of the GRPO maths and the test that catches each\n\n"
            f"`python tests/mutation_check.py`: {len(chosen) - survived} of {len(chosen)} mutations caught, "
            f"{minutes:.0f} min on {platform.machine()} ({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}.\n\n"
            + table + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
