"""A 4-bit frozen base for LoRA (`grpo.lora.quantize_base: nf4`): the decoder layers' projection weights stored as
torchao's NF4 tensors, as torchtune's QLoRA stores them; embeddings, norms and the vocabulary head stay as they are.

Quantize on the device the model runs on, after every move: a move with a dtype (`model.to("cuda", dtype=...)`)
may hand back dense weights for NF4 ones without a word (torchao's conversion); `nf4_count` says how many are NF4 now.

Each forward dequantizes a weight to its original dtype as it multiplies (`F.linear` on an NF4 tensor), so values
are those of the dequantized weight: NF4 keeps 4 bits a value plus a scale per block of `BLOCK` values (and an
8-bit scale of those scales), against bfloat16's 16 bits a value. Weights whose size does not
split into such blocks stay dense.
"""

from __future__ import annotations

from typing import Any

import torch

from components.config import ConfigError

BLOCK = 64  # values sharing one scale (torchao's and torchtune's default)
SCALER_BLOCK = 256  # block scales sharing one scale, at most (a smaller power of two where the count needs it)


def _scaler_block(blocks: int) -> int | None:
    size = SCALER_BLOCK
    while size > 1 and blocks % size:
        size //= 2
    return size if size > 1 else None


def quantize_base(model: Any, method: str) -> tuple[int, int]:
    """Replace the decoder layers' `nn.Linear` weights with frozen NF4 tensors, in place, before LoRA is attached.
    Returns (weights quantized, weights left dense)."""
    if method != "nf4":
        raise ConfigError(f"grpo.lora.quantize_base: {method!r} is not a quantization this pipeline knows (nf4)")
    try:
        from torchao.quantization import to_nf4
    except ImportError as err:
        raise ConfigError("grpo.lora.quantize_base: nf4 needs torchao (pip install -c constraints.txt -e "
                          f"'.[qlora]'); it is not importable here ({err})") from err
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(f"grpo.lora.quantize_base: {type(model).__name__} has no decoder layers (model.layers)")
    done = dense = 0
    for layer in layers:
        for module in layer.modules():
            if type(module) is not torch.nn.Linear:
                continue
            weight = module.weight.detach()
            scaler = _scaler_block(weight.numel() // BLOCK) if weight.numel() % BLOCK == 0 else None
            if scaler is None:
                dense += 1
                continue
            module.weight = torch.nn.Parameter(to_nf4(weight, BLOCK, scaler), requires_grad=False)
            done += 1
    if nf4_count(model) != done:
        raise RuntimeError(f"grpo.lora.quantize_base: {done} weights were quantized but {nf4_count(model)} are NF4")
    return done, dense


def nf4_count(model: Any) -> int:
    """How many of `model`'s parameters are NF4 tensors now (0 without torchao)."""
    try:
        from torchao.quantization import NF4Tensor
    except ImportError:
        return 0
    return sum(isinstance(p, NF4Tensor) for p in model.parameters())
