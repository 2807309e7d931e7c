"""The ops of one decode step of the CUDA-graph engine (the step a graph captures), counted at a model's shape, with
any device-to-host synchronisation refused.

A captured step must never wait for the device: a sync inside it cannot be captured at all, and one in the eager loop
stalls every launch behind it. Each op the step dispatches is a kernel launch or more, so the count is what a
replay saves over launching them one by one, and a step that grows is a slower uncaptured fallback. The step runs in
bfloat16 on the CPU under `StepOps` (a `TorchDispatchMode`), which raises `HostSync` on any op that makes the host
wait for a device's result (`_local_scalar_dense`: `int()`, `.item()`, `if tensor`; `nonzero`; boolean-mask indexing;
...) and counts the rest by op.

    python benchmarks/decode_step_ops.py        # writes benchmarks/results/decode_step_ops.{json,md}

tests/engine/generation/engines/test_decode_step_ops.py counts again and fails when any setting's count grows by more
than `GROWTH` over the record.
"""

from __future__ import annotations

import collections
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.shapes import SHAPES, random_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "decode_step_ops.json"
GROWTH = 0.10  # a count more than this far over the record fails the test
SHAPE, ROWS, PROMPT_TOKENS = "smollm2-135m", 8, 16  # the count depends on the layers, not on rows or widths
SETTINGS: dict[str, dict[str, Any]] = {  # SamplingParams of each counted step
    "grpo default (temperature 1, no top-k or top-p)": dict(temperature=1.0),
    "filtered (temperature 0.7, top-k 50, top-p 0.9)": dict(temperature=0.7, top_k=50, top_p=0.9),
    "greedy (evaluation)": dict(greedy=True),
}
# Ops that only describe memory already there (no kernel runs for them).
VIEW_OPS = frozenset({"slice", "select", "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "unsqueeze",
                      "squeeze", "expand", "as_strided", "split", "split_with_sizes", "unflatten", "flatten", "alias",
                      "detach", "unbind", "narrow", "view_as_real", "view_as_complex", "chunk", "_reshape_alias"})
# Ops that make the host wait for a device's result (on a CUDA tensor), whatever their arguments.
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "nonzero_numpy", "argwhere",
                      "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "bincount",
                      "histc", "histogram", "_assert_async", "allclose", "is_set_to", "_to_cpu", "tolist"})
# Ops that sync only when an index is a boolean mask (its true entries must be counted on the host first).
MASK_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl", "_index_put_impl_", "_unsafe_index",
                            "_unsafe_index_put"})


class HostSync(RuntimeError):
    """An op inside the step that waits for the device (it would fail a capture and stall an uncaptured step)."""


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


class StepOps(TorchDispatchMode):
    """Counts the ops dispatched inside it by name (`ops`); raises `HostSync` on a synchronising op, and on
    `repeat_interleave` with tensor repeats and no output size (its output length is read back from the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            raise HostSync(f"{func}: waits for the device")
        if name in MASK_INDEX_OPS and any(_is_mask(i) for i in _indices(args, kwargs)):
            raise HostSync(f"{func} with a boolean mask: its true entries are counted on the host")
        if name == "repeat_interleave" and isinstance(args[0] if args else None, torch.Tensor) and \
                kwargs.get("output_size") is None and (len(args) < 2 or isinstance(args[1], torch.Tensor)):
            raise HostSync(f"{func} without output_size: its length is read back from the device")
        self.ops[name] += 1
        return func(*args, **kwargs)


def _indices(args: tuple, kwargs: dict) -> list[Any]:
    indices = kwargs.get("indices", args[1] if len(args) > 1 else None)
    return list(indices) if isinstance(indices, (list, tuple)) else []


def step_engine(shape: str = SHAPE, dtype: torch.dtype = torch.bfloat16) -> Any:
    """The CUDA-graph engine (eager mode: the step a graph captures, run as it is) over a random model of `shape`."""
    from components.engine.generation.engines.base import SpecialTokens
    from components.engine.generation.engines.cuda_graphs import CudaGraphEngine
    from components.engine.generation.engines.prefix_shared import PrefixSharedEngine
    from components.engine.generation.fast.fastlm import PrefixSharedLM
    from components.engine.generation.fast.pieces import FastOptions

    vocab = SHAPES[shape]["vocab_size"]
    model = random_model(shape, dtype, "cpu").eval()
    tokens = SpecialTokens(eos_id=vocab - 1, pad_id=vocab - 2)
    base = PrefixSharedEngine(PrefixSharedLM(model, FastOptions(onednn_matmul=False)), tokens)  # as on a GPU
    return CudaGraphEngine(base, "eager", max_length=PROMPT_TOKENS + 8)


def count_step(engine: Any, settings: dict[str, Any]) -> collections.Counter[str]:
    """The ops of one fused decode step of `engine` over `ROWS` started rows, by name (raises `HostSync`)."""
    from components.engine.generation.engines.base import SamplingParams
    from components.engine.generation.engines.static_cache import key_bucket, row_bucket
    from components.engine.generation.rollouts import left_pad

    params = SamplingParams(n=ROWS // 2, max_new_tokens=8, **settings)
    vocab = engine.pieces.vocab_size
    prompts = torch.randint(0, vocab - 2, (2, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)).tolist()
    device = torch.device("cpu")
    prompt_ids, prompt_mask = left_pad(prompts, engine.tokens.pad_id, device)
    with torch.inference_mode():
        state = engine._state_for(ROWS, PROMPT_TOKENS, params.max_new_tokens, device)
        state.refresh_weights()
        n = state.start(prompt_ids, prompt_mask, params.n)
        generator = engine._own_generator(device)
        keys = key_bucket(int(state.column) + 1, state.length)
        with StepOps() as counter:
            engine._fused_step(state, row_bucket(n), keys, params, generator, engine.tokens.eos_id)
    return counter.ops


def launching(counts: collections.Counter[str]) -> int:
    """The ops of `counts` that run a kernel (views excluded; `reshape` of a non-contiguous tensor copies, counted
    as a view here)."""
    return sum(k for op, k in counts.items() if op not in VIEW_OPS)


def measure() -> dict[str, Any]:
    engine = step_engine()
    counts = {name: count_step(engine, settings) for name, settings in SETTINGS.items()}
    return {"shape": SHAPE, "dtype": "bfloat16", "rows": ROWS, "layers": SHAPES[SHAPE]["num_hidden_layers"],
            "torch": torch.__version__, "machine": f"{platform.machine()} CPU (the ops a CUDA step dispatches: "
                                                  "the same aten ops, each one launch or more)",
            "settings": {name: {"total": sum(c.values()), "launching": launching(c), "by_op": dict(c.most_common())}
                         for name, c in counts.items()}}


def markdown(record: dict[str, Any]) -> str:
    lines = ["# Ops of one decode step (benchmarks/decode_step_ops.py)", "",
             f"{record['shape']} ({record['layers']} layers), {record['dtype']}, {record['rows']} rows; torch "
             f"{record['torch']}, counted on the {record['machine']}. No op waits for the device (checked by the "
             "same run). tests/engine/generation/engines/test_decode_step_ops.py fails when a count grows by more than "
             f"{GROWTH:.0%}.", "", "| setting | ops a step | of them not views | largest (not views) |",
             "|---|---:|---:|---|"]
    for name, s in record["settings"].items():
        top = ", ".join([f"`{op}` {k}" for op, k in s["by_op"].items() if op not in VIEW_OPS][:6])
        lines.append(f"| {name} | {s['total']:,} | {s['launching']:,} | {top} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    record = measure()
    RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    RESULTS.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
