"""The fast path checks itself against the Hugging Face forward it replaces, once when built: log-probs and
entropies on small left-padded batches (repeated prompts, a prompt that differs only in its mask, a shared prefix),
and in training mode the gradients through a repeated row. `build.checked_prefix_shared_lm` returns None when a
check fails, and the rollout engine (`rollout.prefix_shared.build`) falls back to the plain forward when anything
raises.

In float32 the two forwards differ only in the order of their sums, so they must agree to `CHECK_TOLERANCE`. A
bfloat16 or float16 model rounds far more than that (a real model's log-probs move by tenths of a nat from its own
float32 values, Hugging Face's forward and this one alike), so a fixed tolerance either refuses every such model or
lets real faults through. There the check runs twice: once with the weights in float32 (bfloat16 and float16 values
are exact in float32, so the round trip changes nothing), where the forwards must agree to `CHECK_TOLERANCE`, then in
the model's own dtype, where this forward may stray from those float32 values at most `HALF_PRECISION_MARGIN` times
as far as Hugging Face's own forward in that dtype does.

Both checks run on the decoder's representative layers (`representative_layers`): the first, the last and the first
of every other kind. Layers of one kind run the same code on other weights, so the rest would check nothing new, and
the cost of a check stops growing with depth (a 30-layer model is checked on 2)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Literal

import psutil
import torch

from components.engine.generation.fast.fastlm import PrefixSharedLM
from components.engine.generation.fast.rows import SHARED_PREFIX_MIN
from components.engine.generation.logprobs import completion_logprobs
from components.engine.generation.rollouts import Turn

MAX_CHECK_LENGTH = 1024  # self-check rows are this long at most (the attention rules hold at any length)
SHARED_CHECK_LENGTH = 2 * SHARED_PREFIX_MIN + 4  # the shared-prefix batch's prompts: long enough to share, no longer
CHECK_TOLERANCE = 1e-3  # float32: the largest log-prob or entropy difference (gradients: of their largest value)
HALF_PRECISION_MARGIN = 2.0  # half precision: distance from the float32 values, as a multiple of Hugging Face's own
EXACT = (torch.float32, torch.float64)


@contextlib.contextmanager
def float32_weights(model: Any) -> Iterator[None]:
    """Every bfloat16/float16 parameter held in float32 while inside, then put back bit for bit. Raises MemoryError
    (the fast path is then off, said) when the device has no room for the float32 copy."""
    low = [p for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)]
    extra = sum(p.numel() * (4 - p.element_size()) for p in low)
    device = low[0].device if low else torch.device("cpu")
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    if extra and free < 1.2 * extra + 2**28:
        raise MemoryError(f"the self-check needs {extra / 2**30:.1f} GiB more to run the weights in float32 and "
                          f"{free / 2**30:.1f} GiB are free")
    dtypes = [p.dtype for p in low]
    for p in low:
        p.data = p.data.float()
    try:
        yield
    finally:
        for p, dtype in zip(low, dtypes):
            p.data = p.data.to(dtype)


def layer_kind(layer: Any) -> tuple:
    """What decides how a decoder layer computes: its modules' names and classes (a LoRA-wrapped projection is
    another class), its parameters' shapes, dtypes and whether they train, and its attention type where it has one."""
    modules = tuple((name, type(module).__qualname__) for name, module in layer.named_modules())
    parameters = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in layer.named_parameters())
    attention = getattr(layer, "attention_type", None), getattr(getattr(layer, "self_attn", None), "sliding_window",
                                                               None)
    return modules, parameters, attention


@contextlib.contextmanager
def representative_layers(lm: PrefixSharedLM) -> Iterator[int]:
    """The decoder holding only its first and last layers and the first layer of every other `layer_kind` while
    inside (both forwards run the decoder's `layers`, Hugging Face's up to `num_hidden_layers`, which the list is
    never longer than; `config.layer_types`, which Hugging Face's forward reads by position, follows the kept
    layers); yields how many, and puts the whole list back on leaving."""
    decoder, layers = lm.pieces.decoder, lm.pieces.layers
    kinds, chosen = set(), []
    for index, layer in enumerate(layers):
        kind = layer_kind(layer)
        if index in (0, len(layers) - 1) or kind not in kinds:
            chosen.append(index)
            kinds.add(kind)
    if len(chosen) == len(layers):
        yield len(layers)
        return
    config = decoder.config
    types = getattr(config, "layer_types", None)  # Hugging Face's forward reads layer i's type at index i
    decoder.layers = torch.nn.ModuleList(layers[i] for i in chosen)
    if types is not None:
        config.layer_types = [types[i] for i in chosen]
    try:
        yield len(chosen)
    finally:
        decoder.layers = layers
        if types is not None:
            config.layer_types = types


def _agrees(ours: torch.Tensor, theirs: torch.Tensor, scale: float = 1.0) -> bool:
    """Finite, and no value further than `CHECK_TOLERANCE` x `scale` from its counterpart."""
    return bool(torch.isfinite(ours).all()) and float((ours - theirs).abs().max()) <= CHECK_TOLERANCE * scale


def _rounds_like_hugging_face(ours: list[torch.Tensor], theirs: list[torch.Tensor], exact: list[torch.Tensor]) -> bool:
    """Half precision: finite, and all values together no further from the float32 ones `exact` (Euclidean distance)
    than `HALF_PRECISION_MARGIN` times Hugging Face's own. The total, not the largest single error: one token's or
    one tensor's rounding error swings more from case to case than the total does."""
    flat = [torch.cat([t.float().flatten() for t in values]) for values in (ours, theirs, exact)]
    if not bool(torch.isfinite(flat[0]).all()):
        return False
    ours_off, theirs_off = (float(torch.linalg.vector_norm(v - flat[2])) for v in flat[:2])
    return ours_off <= HALF_PRECISION_MARGIN * theirs_off + CHECK_TOLERANCE * float(torch.linalg.vector_norm(flat[2]))


@torch.no_grad()
def matches_reference_forward(lm: PrefixSharedLM, vocab_size: int, prompt_length: int = 5,
                              completion_length: int = 4) -> bool:
    """Compare token log-probs and entropies with the Hugging Face forward on small left-padded batches.

    Rows 3 and 4 repeat row 0's prompt ids side by side, row 4 with another mask (a padded token made
    real), so the check fails if prompts that differ only in their mask are merged; row 1 ends early,
    so the packed forward is checked against padding too. When prompts this long can share a prefix
    worth encoding once, a batch whose prompts share their first tokens checks that path. The entropies depend
    on every logit. These batches, in both attention layouts (`attention.attention_rows`), whichever "auto" would
    take, run on rows of at most `SHARED_CHECK_LENGTH` prompt and 4 completion tokens: where a row, a group or a
    prefix ends and the offsets after it do not depend on length. The positions do: rows 0 and 1 (left padding, an
    early end) run again as long as asked (the positions the engine will use), in completion rows. Hugging Face's
    forward runs once per batch: a check costs one long forward of two rows of each kind.
    """
    both: tuple[Literal["group", "completion"], ...] = ("group", "completion")
    short_length, short_completion = min(prompt_length, SHARED_CHECK_LENGTH), min(completion_length, 4)
    plan = [(check_batch(lm, vocab_size, short_length, short_completion, shared_head=0), both)]
    if (short_length, short_completion) != (prompt_length, completion_length):
        rows_0_1 = tuple(t[:2] for t in check_batch(lm, vocab_size, prompt_length, completion_length, shared_head=0))
        plan.append((rows_0_1, ("completion",)))
    if prompt_length - 3 >= SHARED_PREFIX_MIN:
        head = max(SHARED_PREFIX_MIN, (short_length - 2) // 2)
        plan.append((check_batch(lm, vocab_size, short_length, short_completion, shared_head=head), both))
    was_training = lm.model.training
    lm.model.eval()

    def compared() -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(ours, Hugging Face's) for each batch and layout, Hugging Face's computed once per batch."""
        pairs = []
        for batch, layouts in plan:
            theirs = _values(partial(completion_logprobs, lm.model), batch)
            pairs += [(_values(lm.with_options(attention_rows=rows).completion_logprobs, batch), theirs)
                      for rows in layouts]
        return pairs

    try:
        if lm.pieces.dtype in EXACT:
            return all(_agrees(ours, theirs) for ours, theirs in compared())
        with float32_weights(lm.model):  # the structure, exactly
            exact = compared()
            if not all(_agrees(ours, theirs) for ours, theirs in exact):
                return False
        return all(_rounds_like_hugging_face([ours], [theirs], [float32_values])  # then the dtype's rounding
                   for (ours, theirs), (_, float32_values) in zip(compared(), exact))
    finally:
        lm.model.train(was_training)


def trains_like_reference_forward(lm: PrefixSharedLM, vocab_size: int) -> bool:
    """One training-mode forward and backward on a small batch with a repeated row (computed once here): the
    gradients of a weighted sum of its completion log-probs must agree with the Hugging Face forward's, for
    the first and last decoder layers' trainable weights (every layer's backward lies between them). Dropout
    is off for the check only, so both forwards compute the same function."""
    prompt, mask, completion, completion_mask = check_batch(lm, vocab_size, 5, 4, shared_head=0)
    rows = torch.tensor([0, 1, 2, 3, 4, 0], device=prompt.device)  # the last row repeats the first
    checked = Turn(prompt[rows], mask[rows], completion[rows], completion_mask[rows],
                       torch.zeros(len(rows), dtype=torch.bool, device=prompt.device))
    weights = torch.linspace(-1.0, 1.0, len(rows), device=prompt.device)[:, None] * checked.completion_mask
    layers = lm.pieces.layers
    params = [p for layer in (layers[0], layers[-1]) for p in layer.parameters() if p.requires_grad]
    if not params:
        return True  # nothing trains in those layers: nothing to compare
    was_training, rates = lm.model.training, [(m, m.p) for m in lm.pieces.dropouts]

    def gradients() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        plain = completion_logprobs(lm.model, checked)[0]  # Hugging Face's forward
        theirs = torch.autograd.grad((plain * weights).sum(), params)
        ours = torch.autograd.grad((lm.completion_logprobs(checked)[0] * weights).sum(), params)
        return [g.float() for g in ours], [g.float() for g in theirs]

    try:
        lm.model.train()
        for module, _ in rates:
            module.p = 0.0
        exact = None
        if lm.pieces.dtype not in EXACT:
            with float32_weights(lm.model):  # the structure, exactly; then the dtype's rounding against it
                ours, exact = gradients()
                if not all(_agrees(a, b, float(b.abs().max()) + 1e-6) for a, b in zip(ours, exact)):
                    return False
        ours, theirs = gradients()
    finally:
        for module, rate in rates:
            module.p = rate
        lm.model.train(was_training)
    if exact is not None:
        return _rounds_like_hugging_face(ours, theirs, exact)
    return all(_agrees(a, b, float(b.abs().max()) + 1e-6) for a, b in zip(ours, theirs))


def check_batch(lm: PrefixSharedLM, vocab_size: int, prompt_length: int, completion_length: int, shared_head: int):
    device = next(lm.model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab_size, (3, prompt_length), generator=gen)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    mask[0, :1] = 0
    if shared_head:  # rows 1 and 2 start with row 0's first real tokens
        prompt[1, 2:2 + shared_head] = prompt[2, :shared_head] = prompt[0, 1:1 + shared_head]
    completion = torch.randint(0, vocab_size, (3, completion_length), generator=gen)
    prompt = torch.cat([prompt, prompt[:1], prompt[:1]])  # a repeated prompt exercises the shared path
    mask = torch.cat([mask, mask[:1], mask[:1] if shared_head else torch.ones_like(mask[:1])])
    completion = torch.cat([completion, completion[2:3], completion[1:2]])
    completion_mask = torch.ones_like(completion)
    completion_mask[1, max(1, completion_length // 2):] = 0
    return tuple(t.to(device) for t in (prompt, mask, completion, completion_mask))


def _values(logprobs: Callable[..., tuple[torch.Tensor, torch.Tensor]], batch: tuple) -> torch.Tensor:
    """A forward's log-probs and entropies of the batch's real completion tokens, side by side."""
    prompt, mask, completion, completion_mask = batch
    checked = Turn(prompt, mask, completion, completion_mask, torch.zeros(len(completion), dtype=torch.bool))
    logp, entropy = logprobs(checked, with_entropy=True)
    real = completion_mask.bool()
    return torch.cat([logp[real], entropy[real]])
