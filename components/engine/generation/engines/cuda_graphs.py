"""The CUDA-graph engine: the prompt-once engine's scoring, and decoding whose every step is one captured CUDA graph.

A decode step of a small model is a few hundred small kernels; launched one by one from Python, the launches, not
the GPU, set the pace. Here the step (every layer's projections, attention over a preallocated KV cache, the
vocabulary head, then temperature, top-k, top-p and the draw, the EOS check and the writes of token and log-prob) is
captured once per shape with `torch.cuda.CUDAGraph` and replayed: one launch a token. Shapes are fixed per row
bucket (a power of two; finished rows are compacted out when the open rows fit the next smaller bucket) and per
key block (`static_cache.KEY_BLOCK` cache columns); each group's prompt is prefilled once (`static_cache.py`).
The host looks at the rows only every `check_every` steps (to stop or compact), so up to that many steps may run
after the last row finished; their tokens are padding and are cut off.

Why `torch.cuda.CUDAGraph` directly and not `torch.compile(mode="reduce-overhead")`: the step writes its caches,
mask and counters in place, which CUDA-graph trees refuse to capture (they would run the step ungraphed), and each
of the dozens of (rows, keys) shapes would be a compilation. `compile_step=True` keeps the direct graphs and
compiles the step's arithmetic with Inductor first (fewer, fused kernels inside each graph): a measured option
(benchmarks/gpu_rows.py), off by default.

Modes: `graphs` (CUDA), `eager` (the same fused loop, uncaptured: how its logic is tested on the CPU) and
`token_loop` (the host-driven loop of token_loop.py over the same fixed-shape state: one uniform per open row a
step, so the same seed gives the plain engine's tokens; the CPU mode and the fallback). Graph mode draws for every
row of a bucket, so it consumes its generator otherwise than the plain path: the same seed gives other (equally
distributed) tokens. If a capture fails, one line says so and decoding goes on uncaptured.

The fused loop draws from one generator the engine owns (a graph reads the generator registered with it at capture,
whatever the caller passes later): the caller's generator state (or the device's default generator's) is copied in
before a run and back after it, so a new generator per call (pass@k) replays the same graphs, its seed is honoured and
it moves on as if it had drawn itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from components.engine.generation.engines.base import EngineRun, SamplingParams
from components.engine.generation.engines.draw import draw
from components.engine.generation.engines.prefix_shared import PrefixSharedEngine
from components.engine.generation.engines.static_cache import (
    KEY_BLOCK,
    StaticState,
    distinct_index_writes,
    key_bucket,
    row_bucket,
)
from components.engine.generation.engines.token_loop import decode
from components.engine.generation.fast.pieces import ModelPieces
from components.engine.generation.rollouts import Turn, left_pad
from components.rollout_engines import CudaGraphs

Mode = Literal["graphs", "eager", "token_loop"]
CHECK_EVERY = 8  # decode steps between the host's looks at which rows are open (each look waits for the GPU)


class CudaGraphEngine:
    """Samples with fixed-shape decode steps (captured as CUDA graphs in `graphs` mode) and scores with the
    prompt-once forward of `base`. Sampling runs under `torch.inference_mode`; the rollouts are then cloned."""

    name = "cuda_graphs"

    def __init__(self, base: PrefixSharedEngine, mode: Mode = "graphs", max_length: int | None = None,
                 check_every: int = CHECK_EVERY, compile_step: bool = False, say: Callable[..., None] = print):
        """`max_length`: the longest prompt + completion row expected (the cache is sized for it once)."""
        self.base, self.tokens, self.mode, self.say = base, base.tokens, mode, say
        self.max_length, self.check_every, self.compile_step = max_length, check_every, compile_step
        lm = base.lm
        self.pieces = ModelPieces(lm.model, dataclasses.replace(lm.options, complex_rotary=False))
        self.state: StaticState | None = None
        self.graphs: dict[tuple, Any] = {}
        self.generator: torch.Generator | None = None  # what the fused loop draws from (`_own_generator`)
        self.pool: Any = None
        self.stream: Any = None
        self._step = self._fused_step

    def start(self, prompts: Sequence[Sequence[int]], continuing: bool = False) -> StaticDecoding:
        return StaticDecoding(self, prompts, continuing)

    def sample(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Turn:
        return self.start(prompts).turn(params, generator)

    def logprobs(self, rollouts: Turn, temperature: float,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.base.logprobs(rollouts, temperature, with_entropy)

    def over(self, model: Any) -> CudaGraphEngine:
        return CudaGraphEngine(self.base.over(model), self.mode, self.max_length, self.check_every, self.compile_step,
                               self.say)

    # ----------------------------------------------------------------------------------------- state
    def _state_for(self, rows: int, prompt_width: int, max_new_tokens: int, device: torch.device,
                   continuing: bool = False) -> StaticState:
        """The fixed-shape state, reallocated (and every graph dropped) only when this run does not fit it. A
        continuing run's rows reach `max_length`, with a turn's worth more: its rows' answers are fed in lockstep."""
        s = self.state
        needed = max(prompt_width, (self.max_length or 0) if continuing else 0) + max_new_tokens
        if s is None or rows > s.capacity or needed > s.length or max_new_tokens != s.max_new_tokens:
            length = -(-max(needed, self.max_length or 0) // KEY_BLOCK) * KEY_BLOCK
            self.state, self.graphs = None, {}
            self.state = StaticState(self.pieces, row_bucket(rows), length, max_new_tokens, self.pieces.vocab_size,
                                     device)
        return self.state

    # ---------------------------------------------------------------------------- the fused (captured) loop
    def _fused_decode(self, state: StaticState, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      params: SamplingParams, generator: torch.Generator | None, continuing: bool,
                      first: bool) -> Turn:
        """Every step fused (draw, record, feed); in `graphs` mode each (rows, keys) shape is captured first (for a
        continuing run every key block up to the state's length, with the first turn: a capture between turns would
        overwrite the live state)."""
        eos = -1 if params.ignore_eos else self.tokens.eos_id
        own = self._own_generator(prompt_ids.device)
        step = lambda rows, keys: self._step(state, rows, keys, params, own, eos)  # noqa: E731
        width = prompt_ids.shape[1]  # the cache columns a prompt takes, at most (a shared prefix takes fewer)
        n = len(prompt_ids) * params.n if first else len(prompt_ids)
        if self.mode == "graphs" and first:
            try:
                self._capture_all(state, row_bucket(n), width, params, step,
                                  state.length - width - 1 if continuing else params.max_new_tokens)
            except Exception as err:  # noqa: BLE001 - a capture that fails costs speed, never the run
                self.say(f"grpo: CUDA graphs off: capturing the decode step failed ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}); decoding uncaptured", flush=True)
                self.mode, self.graphs = "token_loop", {}
                n = state.start(prompt_ids, prompt_mask, params.n)
                return decode(_TokenLoopDecoder(state, n, not continuing), prompt_ids, prompt_mask, params,
                              self.tokens, generator)
        caller = generator if generator is not None else _default_generator(prompt_ids.device)
        own.set_state(caller.get_state())  # after the warm-ups: they drew from `own`, never from the caller's
        if first:
            n = state.start(prompt_ids, prompt_mask, params.n)
        steps = self._run(state, n, params, step, compact=not continuing)
        caller.set_state(own.get_state())
        return _rollouts(state, n, steps, prompt_ids, prompt_mask, params, eos)

    def _own_generator(self, device: torch.device) -> torch.Generator:
        """The generator every captured step draws from, made once per engine (and device)."""
        if self.generator is None or self.generator.device != device:
            self.generator, self.graphs = torch.Generator(device=device), {}
        return self.generator

    def _run(self, state: StaticState, n: int, params: SamplingParams, step: Callable[[int, int], None],
             compact: bool = True) -> int:
        """The steps of a started turn (replays where a graph was captured, an eager step elsewhere); returns how
        many ran. `compact`: finished rows leave once the open ones fit the next smaller bucket."""
        rows, start, steps = row_bucket(n), int(state.column), 0
        while steps < params.max_new_tokens:
            keys = key_bucket(start + steps + 1, state.length)
            graph = self.graphs.get(_key(rows, keys, params))
            if graph is not None:
                graph.replay()
            else:
                step(rows, keys)
            steps += 1
            if steps >= params.max_new_tokens:
                break
            if steps % self.check_every:
                continue
            still = state.open[:rows].nonzero().squeeze(1)  # waits for the GPU
            if len(still) == 0:
                break
            if compact and len(still) <= rows // 2:
                state.compact(still)
                rows = row_bucket(len(still))
        return steps

    def _fused_step(self, state: StaticState, rows: int, keys: int, params: SamplingParams,
                    generator: torch.Generator | None, eos: int) -> None:
        """Draw token t for the first `rows` slots, record it (padding for closed rows), close rows that drew EOS,
        and feed it. No host synchronisation: this is what a graph captures."""
        logits, open_rows = state.logits[:rows], state.open[:rows]
        if params.greedy:
            drawn, logp = logits.argmax(-1), None
        else:
            drawn, logp = draw(logits, params.temperature, params.top_k, params.top_p, generator)
        drawn = torch.where(open_rows, drawn, self.tokens.pad_id)
        slot = state.row_of[:rows] * state.max_new_tokens + state.step  # distinct but the spare row's, never read
        with distinct_index_writes():
            state.out_tokens.index_copy_(0, slot, drawn)
            if logp is not None:
                state.out_logp.index_copy_(0, slot, torch.where(open_rows, logp.float(), 0.0))
        if eos >= 0:
            open_rows.logical_and_(drawn != eos)
        state.tokens[:rows].copy_(drawn)
        state.logits[:rows].copy_(state.forward(rows, keys))

    def _capture_all(self, state: StaticState, top_rows: int, width: int, params: SamplingParams,
                     step: Callable[[int, int], None], steps: int) -> None:
        """Capture every (row bucket, key block) this run may meet that is not captured yet, each with the engine's
        own generator registered. Warm-up steps run first on the capture stream (their draws move the engine's
        generator, whose state the caller's replaces before the run; the run state is laid anew by
        `StaticState.start`)."""
        keys_needed = sorted({key_bucket(width + t + 1, state.length) for t in range(steps)})
        shapes = [(rows, keys) for rows in _buckets(top_rows) for keys in keys_needed
                  if _key(rows, keys, params) not in self.graphs]
        if not shapes:
            return
        if self.compile_step and self._step == self._fused_step:
            self._step = torch.compile(self._fused_step, dynamic=True)  # Inductor's kernels; the graphs stay ours
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        # warm-ups and captures on one stream (cuBLAS keeps a workspace per stream), the same for every capture
        self.stream = stream = self.stream or torch.cuda.Stream()
        try:
            for rows, keys in shapes:
                _in_range(state, keys)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    step(rows, keys)  # warm-up: lazy initialisation (cuBLAS, compilation) happens outside capture
                _in_range(state, keys)  # what the capture records reads these at each replay, not now
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                graph.register_generator_state(self.generator)
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    step(rows, keys)
                self.graphs[_key(rows, keys, params)] = graph
        finally:
            torch.cuda.synchronize()


class StaticDecoding:
    """`base.Decoding` over the engine's fixed-shape state: each turn decodes in place (captured steps in `graphs`
    mode, the token loop in `token_loop` mode); the rows that go on have their answers fed over their caches
    (`StaticState.extend`). A continuing run never compacts rows within a turn, and sizes the state for the engine's
    `max_length` (the longest row an episode can make) with the first turn's token budget."""

    def __init__(self, engine: CudaGraphEngine, prompts: Sequence[Sequence[int]], continuing: bool):
        self.engine, self.continuing = engine, continuing
        device = next(engine.base.lm.model.parameters()).device
        self.prompt_ids, self.prompt_mask = left_pad(prompts, engine.tokens.pad_id, device)
        self.n: int | None = None  # rows of the turn to come (None: the first has not run)
        self.last: Turn | None = None
        self.fed_all = True  # whether the last turn fed every token it drew (the token loop leaves its last step's)

    def turn(self, params: SamplingParams, generator: torch.Generator | None = None) -> Turn:
        engine, first = self.engine, self.n is None
        with torch.inference_mode():
            if first:
                state = engine._state_for(len(self.prompt_ids) * params.n, self.prompt_ids.shape[1],
                                          params.max_new_tokens, self.prompt_ids.device, self.continuing)
                if not state.refresh_weights():
                    engine.graphs.clear()
                prompt_ids, prompt_mask = self.prompt_ids, self.prompt_mask
            else:
                state, params = engine.state, dataclasses.replace(params, n=1)
                prompt_ids = prompt_mask = self.prompt_ids.new_zeros((self.n, 0))
            self.fed_all = engine.mode != "token_loop"
            if engine.mode == "token_loop":
                n = state.start(prompt_ids, prompt_mask, params.n) if first else self.n
                rollouts = decode(_TokenLoopDecoder(state, n, not self.continuing), prompt_ids, prompt_mask, params,
                                  engine.tokens, generator)
            else:
                rollouts = engine._fused_decode(state, prompt_ids, prompt_mask, params, generator, self.continuing,
                                                first)
                self.fed_all = engine.mode != "token_loop"  # a failed capture decoded with the token loop
        self.n, self.last = len(rollouts), rollouts
        return rollouts.clone()

    def extend(self, rows: Sequence[int], answers: Sequence[Sequence[int]], room: int) -> None:
        if self.last is None or not self.continuing:
            raise RuntimeError("extend follows a turn of a decoding run started with continuing=True")
        last, state = self.last, self.engine.state
        if room > state.max_new_tokens:
            raise ValueError(f"a turn of {room} tokens does not fit the state's {state.max_new_tokens}")
        lengths = last.completion_mask.sum(-1)
        fed = lengths if self.fed_all else lengths.clamp(max=last.completion_ids.shape[1] - 1)
        keep = torch.tensor(list(rows), dtype=torch.long, device=state.tokens.device)
        chunks = [last.completion_ids[r, int(fed[r]):int(lengths[r])].tolist() + list(a) for r, a in zip(rows, answers)]
        with torch.inference_mode():
            self.n = state.extend(keep, fed.to(keep.device).index_select(0, keep), chunks, room)


def _in_range(state: StaticState, keys: int) -> None:
    """Counters a step over `keys` columns may run with outside a run (warm-ups before `StaticState.start`)."""
    state.step.zero_()
    state.column.fill_(keys - 1)


class _TokenLoopDecoder:
    """`token_loop.StepDecoder` over the fixed-shape state: rows that finished are fed padding until the open rows
    fit the next smaller bucket, then compacted; `advance` returns the open rows' logits in their order."""

    def __init__(self, state: StaticState, n: int, compact: bool = True):
        self.state, self.rows, self.compact = state, row_bucket(n), compact
        self.open = torch.arange(n, device=state.tokens.device)  # the open rows' slots
        self.column = int(state.column)
        self.logits = state.logits[:n]

    def advance(self, drawn: torch.Tensor, still_open: torch.Tensor, pad_id: int) -> torch.Tensor:
        state = self.state
        state.tokens[:self.rows].fill_(pad_id).index_copy_(0, self.open, drawn)
        self.open = self.open[still_open]
        if self.compact and len(self.open) <= self.rows // 2:
            state.compact(self.open)
            self.rows, self.open = row_bucket(len(self.open)), torch.arange(len(self.open), device=self.open.device)
        logits = state.forward(self.rows, key_bucket(self.column + 1, state.length))
        self.column += 1
        return logits if len(self.open) == self.rows else logits.index_select(0, self.open)


def _buckets(top: int) -> list[int]:
    """The row buckets a run that starts at `top` rows can meet: top, top / 2, ..., 1."""
    return [top >> i for i in range(top.bit_length()) if top >> i]


def _key(rows: int, keys: int, params: SamplingParams) -> tuple:
    """What a captured graph is valid for: its shape and the sampling settings baked into it (its generator is the
    engine's own, the same for every graph)."""
    return rows, keys, params.greedy, params.temperature, params.top_k, params.top_p, params.ignore_eos


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator `torch.rand` would use on `device` without one."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _rollouts(state: StaticState, n: int, steps: int, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
              params: SamplingParams, eos: int) -> Turn:
    """Rollouts from the recorded tokens, cut to the longest completion, masked as the token loop masks them."""
    tokens, logp = state.outputs(n, steps)
    is_eos = tokens == eos
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    mask = (~after_eos).long()
    width = int(mask.sum(-1).max()) if n else 0
    tokens, mask, is_eos = tokens[:, :width], mask[:, :width], is_eos[:, :width]
    g = params.n
    return Turn(prompt_ids=prompt_ids.repeat_interleave(g, 0), prompt_mask=prompt_mask.repeat_interleave(g, 0),
                    completion_ids=tokens, completion_mask=mask, truncated=~is_eos.any(-1), group_size=g,
                    sampling_logp=None if params.greedy else logp[:, :width] * mask)


def build(base: PrefixSharedEngine, max_length: int | None, say: Callable[..., None] = print,
          mode: Mode = "graphs", compile_step: bool = False) -> CudaGraphEngine | None:
    """The CUDA-graph engine over a checked prompt-once engine, or None with one line saying why (its decoding
    weights are not plain matmuls, or a trial capture failed): the prompt-once engine then decodes."""
    try:
        engine = CudaGraphEngine(base, mode, max_length, compile_step=compile_step, say=say)
        if mode == "graphs":
            device = next(base.lm.model.parameters()).device
            trial = torch.Generator(device=device).manual_seed(0)
            engine.sample([[base.tokens.eos_id]], SamplingParams(n=2, max_new_tokens=2), trial)
            if engine.mode != "graphs":
                return None
            engine.state, engine.graphs = None, {}  # the trial's small state: the first run sizes its own
    except Exception as err:  # noqa: BLE001 - whatever broke, the prompt-once engine still decodes
        say(f"grpo: CUDA graphs off: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}; "
            "decoding with the prompt-once engine", flush=True)
        return None
    return engine


def build_for_run(base: PrefixSharedEngine, tokens: Any, run: EngineRun, settings: CudaGraphs,
                  say: Callable[..., None] = print) -> CudaGraphEngine | None:
    """Over the prompt-once engine, when `cuda_graphs` is on and its model is on a CUDA device (a trial capture
    decides, `build`), else None."""
    if not settings.cuda_graphs or next(base.lm.model.parameters()).device.type != "cuda":
        return None
    return build(base, run.max_length, say)


def conformance(base: PrefixSharedEngine, tokens: Any, run: EngineRun) -> CudaGraphEngine:
    """Uncaptured on any device: the host-driven loop over the fixed-shape state, which draws the plain path's tokens
    (the fused step and its captures have their own tests: tests/engine/generation/engines/test_cuda_graphs.py)."""
    return CudaGraphEngine(base, "token_loop", run.max_length)
