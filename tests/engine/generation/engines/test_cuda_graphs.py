"""The CUDA-graph engine's own behaviour: buckets, the fused loop (what a graph captures, run uncaptured on the CPU),
compaction, weights refreshed in place, and the fallback when a capture fails. test_engines.py runs its token-loop
mode against the plain engine with every other engine; the tests marked `gpu` capture for real."""

from __future__ import annotations

import pytest
import torch
from test_engines import PROMPTS, TOKENS, VOCAB, _llama, _lora, _three_turns

from components.engine.generation.engines import cuda_graphs, prefix_shared
from components.engine.generation.engines.base import SamplingParams
from components.engine.generation.engines.hf import HFEngine
from components.engine.generation.engines.static_cache import KEY_BLOCK, StaticState, key_bucket, row_bucket
from components.engine.generation.logprobs import completion_logprobs


def _engine(model, mode="eager", check_every=1, say=print):
    base = prefix_shared.build(model, TOKENS, VOCAB, max_length=30, completion_length=12)
    assert base is not None
    return cuda_graphs.CudaGraphEngine(base, mode, max_length=30, check_every=check_every, say=say)


def _both(model, engine, params, prompts=PROMPTS, seed=5):
    plain_gen, our_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    plain = HFEngine(model, TOKENS).sample(prompts, params, plain_gen)
    ours = engine.sample(prompts, params, our_gen)
    return plain, ours, torch.equal(plain_gen.get_state(), our_gen.get_state())


def _assert_same(plain, ours):
    assert torch.equal(ours.completion_ids, plain.completion_ids)
    assert torch.equal(ours.completion_mask, plain.completion_mask)
    assert torch.equal(ours.truncated, plain.truncated)
    assert torch.equal(ours.prompt_ids, plain.prompt_ids)


def _count_compactions(monkeypatch) -> list[int]:
    sizes: list[int] = []
    original = StaticState.compact

    def spy(self, keep):
        sizes.append(len(keep))
        return original(self, keep)

    monkeypatch.setattr(StaticState, "compact", spy)
    return sizes


def test_buckets_are_powers_of_two_and_key_blocks():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert key_bucket(1, 640) == KEY_BLOCK and key_bucket(KEY_BLOCK + 1, 640) == 2 * KEY_BLOCK
    assert key_bucket(700, 640) == 640
    assert cuda_graphs._buckets(16) == [16, 8, 4, 2, 1] and cuda_graphs._buckets(1) == [1]


@pytest.mark.parametrize("check_every", [1, 8])
def test_the_fused_loop_greedy_gives_the_plain_paths_tokens(monkeypatch, check_every):
    """Greedy needs no generator: the fused step (draw, record, close at EOS, feed) and its compaction must give
    the plain path's tokens exactly, whenever the host looks."""
    compactions = _count_compactions(monkeypatch)
    model = _lora()
    plain, ours, _ = _both(model, _engine(model, check_every=check_every),
                           SamplingParams(n=4, max_new_tokens=10, greedy=True))
    lengths = plain.completion_mask.sum(-1)
    assert lengths.min() < lengths.max(), "every row ended at the same step: finished rows never tested"
    _assert_same(plain, ours)
    assert ours.sampling_logp is None
    if check_every == 1:
        assert compactions, "no row bucket was ever compacted"


def test_the_fused_loop_samples_as_the_plain_path_while_every_row_is_open():
    """With every completion at the budget and a power-of-two row count, the fused step draws exactly for the open
    rows, as the token loop does: the same seed then gives the same tokens, log-probs and generator state."""
    model = _llama(0.4)
    params = SamplingParams(n=4, max_new_tokens=9, temperature=0.8, top_k=6, top_p=0.9, ignore_eos=True)
    plain, ours, same_state = _both(model, _engine(model), params, prompts=PROMPTS[:2])
    _assert_same(plain, ours)
    assert same_state, "the fused step consumed the generator otherwise than the token loop"
    torch.testing.assert_close(ours.sampling_logp, plain.sampling_logp, atol=1e-5, rtol=1e-5)


def test_the_fused_loops_sampler_logprobs_follow_rows_through_compaction(monkeypatch):
    """With rows finishing at different steps the fused loop draws other tokens than the token loop (it draws for
    closed rows of a bucket too), but each row's tokens, masks and sampler log-probs must stay that row's."""
    compactions = _count_compactions(monkeypatch)
    model = _llama(0.4)
    rollouts = _engine(model, check_every=1).sample(PROMPTS, SamplingParams(n=4, max_new_tokens=10, temperature=0.7),
                                                     torch.Generator().manual_seed(3))
    assert compactions and len(rollouts) == 12 and rollouts.group_size == 4
    lengths = rollouts.completion_mask.sum(-1)
    assert lengths.min() < lengths.max()
    for ids, mask in zip(rollouts.completion_ids.tolist(), rollouts.completion_mask.tolist()):
        if TOKENS.eos_id in ids:
            k = ids.index(TOKENS.eos_id)
            assert mask == [1] * (k + 1) + [0] * (len(ids) - k - 1)
            assert all(t == TOKENS.pad_id for t in ids[k + 1:])
    expected, _ = completion_logprobs(model, rollouts, 0.7)
    mask = rollouts.completion_mask.bool()
    torch.testing.assert_close(rollouts.sampling_logp[mask], expected[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["token_loop", "eager"])
def test_the_state_is_kept_and_the_weights_follow_the_model(mode):
    """A second run reuses the buffers (no reallocation for a run that fits) and decodes with the weights as they
    are now: an in-place update, as the optimizer makes, reaches the merged LoRA weights; a larger run reallocates."""
    model = _lora()
    engine = _engine(model, mode)
    params = SamplingParams(n=4, max_new_tokens=10, greedy=True)
    _both(model, engine, params)
    state = engine.state
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.5)
    plain, ours, _ = _both(model, engine, params, prompts=PROMPTS[:2])
    _assert_same(plain, ours)
    assert engine.state is state, "a run that fits the buffers reallocated them"
    plain, ours, _ = _both(model, engine, SamplingParams(n=8, max_new_tokens=10, greedy=True))
    _assert_same(plain, ours)
    assert engine.state is not state and engine.state.capacity == 32


def test_decoding_with_adapters_off_never_writes_the_base_weights():
    """The first run with LoRA's adapters off (the reference) must copy the frozen base weights into the decoding
    buffers, not alias them: the next run merges W + s B A into those buffers."""
    model = _lora()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    engine = _engine(model, "token_loop")
    params = SamplingParams(n=2, max_new_tokens=6, greedy=True)
    with model.disable_adapter():
        plain, ours, _ = _both(model, engine, params)
    _assert_same(plain, ours)
    plain, ours, _ = _both(model, engine, params)
    _assert_same(plain, ours)
    for name, p in model.named_parameters():
        if name in base:
            assert torch.equal(p, base[name]), f"{name} was overwritten by decoding"


def test_a_failed_capture_says_so_once_and_decodes_uncaptured(monkeypatch):
    """A capture that fails (simulated here; on the CPU it cannot run at all) costs one line, and the run goes on
    with the token loop: the plain engine's tokens for the same seed."""
    def failing_capture(*_args, **_kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(cuda_graphs.CudaGraphEngine, "_capture_all", failing_capture)
    lines: list[str] = []
    model = _llama(0.4)
    engine = _engine(model, "graphs", say=lambda *a, **_k: lines.append(" ".join(map(str, a))))
    params = SamplingParams(n=4, max_new_tokens=10, temperature=0.9)
    plain, ours, same_state = _both(model, engine, params)
    _assert_same(plain, ours)
    assert same_state
    _both(model, engine, params)
    assert len(lines) == 1 and "CUDA graphs off" in lines[0] and "\n" not in lines[0], lines
    assert "RuntimeError" in lines[0] and engine.mode == "token_loop"


def test_build_refuses_in_one_line_where_no_graph_can_be_captured():
    """`build` tries a capture first; without CUDA it fails, and the prompt-once engine is what the caller keeps."""
    lines: list[str] = []
    base = prefix_shared.build(_llama(0.4), TOKENS, VOCAB, max_length=30, completion_length=12)
    assert cuda_graphs.build(base, 30, say=lambda *a, **_k: lines.append(" ".join(map(str, a)))) is None
    assert len(lines) == 1 and "CUDA graphs off" in lines[0]


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_the_fused_loop_continues_a_conversation_as_reencoding_it_would(greedy):
    """The loop a graph captures, run eagerly: three turns on one state (rows kept to each turn's end, answers fed
    over their caches, each row's real columns packed) draw what three separate runs over whole contexts draw. (The
    fused loop draws for every row of its bucket, so compaction changes which uniforms a row gets: with no look at
    the rows within a turn, `check_every` past the turn, neither run compacts.)"""
    from components.engine.generation.engines.turns import Reencoding

    model = _llama(1.2)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0.9, greedy=greedy)
    engine = _engine(model, "eager", check_every=8)
    gen, ref_gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    continued = _three_turns(engine.start(PROMPTS, continuing=True), params, gen)
    reencoded = _three_turns(Reencoding(_engine(model, "eager", check_every=8), PROMPTS), params, ref_gen)
    for ours, theirs in zip(continued, reencoded):
        assert torch.equal(ours.completion_ids, theirs.completion_ids)
        if not greedy:
            torch.testing.assert_close(ours.sampling_logp, theirs.sampling_logp, atol=1e-5, rtol=1e-5)
    assert torch.equal(gen.get_state(), ref_gen.get_state())


# ------------------------------------------------------------------------------------------ on a GPU
def _on_cuda(model, dtype=torch.float32):
    return model.to("cuda", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_base", ["none", "nf4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_captured_greedy_decoding_gives_the_uncaptured_tokens(dtype, quantize_base):
    """Against the same fused loop run eagerly (the same shapes, so the same kernels: a capture must change nothing;
    the CPU tests hold the eager loop to the plain path's tokens); also over a 4-bit frozen base, quantized on the
    card as the pipeline quantizes it, and still NF4 after the engines are built and have decoded."""
    if quantize_base == "nf4":
        pytest.importorskip("torchao.quantization")
    from components.engine.models.quantize import nf4_count

    model = _lora(quantize_base, "cuda", dtype)
    quantized = nf4_count(model)
    assert quantized == (14 if quantize_base == "nf4" else 0)  # 7 projections x 2 layers
    params = SamplingParams(n=4, max_new_tokens=10, greedy=True)
    captured, uncaptured = _engine(model, "graphs", check_every=2), _engine(model, "eager", check_every=2)
    a = captured.sample(PROMPTS, params, torch.Generator("cuda").manual_seed(1))
    b = uncaptured.sample(PROMPTS, params, torch.Generator("cuda").manual_seed(1))
    assert captured.mode == "graphs" and captured.graphs, "nothing was captured"
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    assert nf4_count(model) == quantized, "the 4-bit base was dequantized on the way"


@pytest.mark.gpu
def test_captured_sampling_honours_each_new_generator_with_the_same_graphs():
    """pass@k on the card: a new generator per call; the graphs of the first call serve every later one, the same
    seed gives the same tokens and the eager loop's, another seed others."""
    model = _on_cuda(_llama(0.4))
    params = SamplingParams(n=4, max_new_tokens=9, temperature=0.8, top_k=6, ignore_eos=True)
    captured, eager = _engine(model, "graphs"), _engine(model, "eager")

    def run(engine, seed):
        return engine.sample(PROMPTS[:2], params, torch.Generator("cuda").manual_seed(seed)).completion_ids

    first = run(captured, 4)
    graphs = len(captured.graphs)
    assert captured.mode == "graphs" and graphs
    for _ in range(3):
        assert torch.equal(run(captured, 4), first)
    assert torch.equal(first, run(eager, 4))
    assert not torch.equal(run(captured, 5), first)
    assert len(captured.graphs) == graphs, "a later call captured again"


@pytest.mark.gpu
def test_captured_sampling_replays_the_generator_as_the_eager_step():
    """Every row open and a power-of-two row count: a replayed graph draws the same uniforms as the eager fused
    step (the generator's state is registered with each graph and moved on by each replay)."""
    model = _on_cuda(_llama(0.4))
    params = SamplingParams(n=4, max_new_tokens=9, temperature=0.8, top_k=6, top_p=0.9, ignore_eos=True)
    results = []
    for mode in ("graphs", "eager"):
        generator = torch.Generator("cuda").manual_seed(7)
        results.append((_engine(model, mode).sample(PROMPTS[:2], params, generator), generator.get_state()))
    (a, state_a), (b, state_b) = results
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(state_a, state_b)
    torch.testing.assert_close(a.sampling_logp, b.sampling_logp)


@pytest.mark.gpu
def test_the_door_chooses_captured_decoding_on_a_gpu():
    from components.engine.generation.engines.base import EngineRun
    from components.engine.generation.engines.choose import build_engine

    lines: list[str] = []
    engine = build_engine(_on_cuda(_llama(0.4)), TOKENS, EngineRun(vocab_size=VOCAB, max_length=30,
                                                                    completion_length=12),
                          say=lambda *a, **_k: lines.append(" ".join(map(str, a))))
    assert engine.name == "cuda_graphs", lines


class _Recorder:
    """Stands in for CUDA's capture on the CPU: a "graph" keeps the step it was captured from and runs it on replay,
    with the generator it was captured with (as a CUDA graph reads the generator registered with it, whatever a later
    caller passes). The claim under test is the engine's bookkeeping around capture (which shapes, when, whose
    generator, every step a replay), not CUDA's capture itself (the `gpu` tests above)."""

    capturing = None

    def __init__(self):
        self.step, self.replays, self.generators = None, 0, []

    def register_generator_state(self, generator):
        self.generators.append(generator)

    def replay(self):
        self.replays += 1
        self.step()


@pytest.fixture
def recorded_capture(monkeypatch):
    """`torch.cuda`'s capture replaced by `_Recorder`; returns (the graphs captured, a function that makes an engine
    whose steps the recorder can replay)."""
    import contextlib

    graphs: list[_Recorder] = []

    @contextlib.contextmanager
    def capture(graph, **_kwargs):
        _Recorder.capturing = graph
        graphs.append(graph)
        yield
        _Recorder.capturing = None

    class _Stream:
        def wait_stream(self, _other):
            pass

    for name, value in {"CUDAGraph": _Recorder, "graph": capture, "Stream": _Stream, "current_stream": _Stream,
                        "stream": lambda _s: contextlib.nullcontext(), "graph_pool_handle": lambda: (0, 0),
                        "synchronize": lambda: None}.items():
        monkeypatch.setattr(torch.cuda, name, value)

    def graphed_engine(model):
        engine = _engine(model, "graphs")
        step = engine._step

        def recorded(*args):
            if _Recorder.capturing is not None:
                _Recorder.capturing.step = lambda: step(*args)
            return step(*args)

        engine._step = recorded
        return engine

    return graphs, graphed_engine


SAMPLED = SamplingParams(n=4, max_new_tokens=9, temperature=0.8, top_k=6, ignore_eos=True)


def _run(engine, seed):
    generator = torch.Generator().manual_seed(seed)  # a new generator per call, as pass@k makes them
    return engine.sample(PROMPTS[:2], SAMPLED, generator), generator.get_state()


def test_graph_mode_bookkeeping_captures_each_shape_once_and_replays_every_step(recorded_capture):
    graphs, graphed_engine = recorded_capture
    model = _llama(0.4)
    eager, graphed = _engine(model, "eager"), graphed_engine(model)
    (a, state_a), (b, state_b), (c, state_c) = _run(eager, 4), _run(graphed, 4), _run(graphed, 4)
    for ours, state in ((b, state_b), (c, state_c)):  # the second run: no capture, its warm-ups or draws
        assert torch.equal(a.completion_ids, ours.completion_ids) and torch.equal(state_a, state), \
            "the warm-ups' draws reached the caller's generator, or a replay differs from the step"
        torch.testing.assert_close(a.sampling_logp, ours.sampling_logp)
    assert graphed.mode == "graphs" and len(graphs) == len(graphed.graphs) == 4  # row buckets 8, 4, 2, 1 x one block
    assert sum(g.replays for g in graphs) == 2 * SAMPLED.max_new_tokens, "a step ran uncaptured"


def test_one_generator_owned_by_the_engine_over_pass_at_k_calls(recorded_capture):
    """Every call with a new generator (pass@k): the graphs of the first call serve them all (each registered with
    the engine's one generator); the caller's seed decides the tokens (the same seed the same tokens, another seed
    others) and the caller's generator moves on exactly as the plain path moves it (every row open, 8 rows: the
    fused loop draws as the token loop does)."""
    graphs, graphed_engine = recorded_capture
    model = _llama(0.4)
    plain, graphed = HFEngine(model, TOKENS), graphed_engine(model)
    expected = {seed: _run(plain, seed) for seed in (4, 5)}
    for call, seed in enumerate((4, 4, 5, 4, 5)):
        rollouts, state = _run(graphed, seed)
        want, want_state = expected[seed]
        assert torch.equal(rollouts.completion_ids, want.completion_ids), f"call {call}: the seed was not honoured"
        assert torch.equal(state, want_state), f"call {call}: the caller's generator did not move on"
        assert len(graphs) == len(graphed.graphs) == 4, f"call {call} captured again"
    assert not torch.equal(expected[4][0].completion_ids, expected[5][0].completion_ids)
    assert all(g.generators == [graphed.generator] for g in graphs), "a graph holds another generator"
    assert sum(g.replays for g in graphs) == 5 * SAMPLED.max_new_tokens, "a step ran uncaptured"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_captured_turns_continue_a_conversation_as_the_eager_loop(dtype):
    """On the card: three turns with every step replayed from graphs captured with the first turn give the eager
    loop's tokens (a capture between turns would overwrite the conversation's state)."""
    model = _llama(1.2).to("cuda", dtype)
    params = SamplingParams(n=2, max_new_tokens=6, greedy=True)
    captured, eager = _engine(model, "graphs", check_every=2), _engine(model, "eager", check_every=2)
    a = _three_turns(captured.start(PROMPTS, continuing=True), params, torch.Generator("cuda").manual_seed(1))
    b = _three_turns(eager.start(PROMPTS, continuing=True), params, torch.Generator("cuda").manual_seed(1))
    assert captured.mode == "graphs" and captured.graphs
    for x, y in zip(a, b):
        assert torch.equal(x.completion_ids, y.completion_ids)
