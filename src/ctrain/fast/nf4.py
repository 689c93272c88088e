"""QLoRA's 4-bit base layers dequantised inside the compiled decoder layers.

bitsandbytes' ``Linear4bit`` runs each projection through Python: its autograd function, its
dispatcher and, for the micro-batches of training (more than 1,536 tokens), a dequantisation
kernel into a fresh bf16 weight and then the matmul, forward and again backward. On an H100 that
Python costs about 0.2 ms a call, 224 projections of an 8B model forward and backward for every
micro-batch: the GPU waited for it (docs/benchmarks.md). Here the same arithmetic (NF4 code
lookup, double-quantised block scales) is written in tensor operations inside the compiled layer,
so the compiler makes one kernel of each projection's dequantisation and launches it with the rest
of the layer; the backward pass dequantises again rather than keep the bf16 weight.

Nothing about the model changes: the packed weights and their quantisation state stay where
bitsandbytes keeps them (checkpoints, merging and evaluation see ``Linear4bit`` as it is); the
module only gains non-persistent buffers that point at the same tensors, so the compiled layers
take them as inputs (one graph for every layer). Layers whose format this does not cover (other
than NF4 in uint8 storage, or a shape that does not fill whole blocks) keep bitsandbytes' forward.
"""

from __future__ import annotations

from typing import Any

__all__ = ["dequantize", "dequantized", "inline_4bit"]

# One subclass per class swapped in (see ctrain.fast.adapters: the class carries the forward, so
# every layer shares one compiled graph).
_SUBCLASSES: dict[type, type] = {}
_BUFFERS = ("packed", "absmax", "code", "absmax_code", "absmax_scale", "absmax_offset")


def dequantize(
    packed: Any,
    absmax: Any,
    code: Any,
    blocksize: int,
    shape: tuple[int, int],
    dtype: Any,
    absmax_code: Any = None,
    absmax_scale: Any = None,
    absmax_offset: Any = None,
    absmax_blocksize: int = 256,
) -> Any:
    """The ``shape`` weight that bitsandbytes packed as 4-bit codes, in ``dtype``.

    ``packed`` holds two codes a byte, the first in the high nibble; each ``blocksize`` run of
    values is ``code[q] * absmax[block]``. With double quantisation ``absmax`` is itself 8-bit:
    ``absmax_code[a] * absmax_scale[a's block of absmax_blocksize] + absmax_offset``. Computed in
    float32 and rounded once to ``dtype``, as bitsandbytes' kernels do.
    """
    import torch

    blocks = shape[0] * shape[1] // blocksize  # from the layer's ints: a static size for the compiler
    if absmax_code is not None:
        if blocks % absmax_blocksize == 0:  # whole blocks of scales: each scale row-broadcast
            absmax = absmax_code[absmax.int()].reshape(-1, absmax_blocksize) * absmax_scale.reshape(-1, 1)
        else:
            index = torch.arange(blocks, device=absmax.device) // absmax_blocksize
            absmax = absmax_code[absmax.int()] * absmax_scale[index]
        absmax = absmax.reshape(-1) + absmax_offset
    # One row a block: each value's scale is its row's, with no index arithmetic per value.
    pairs = packed.reshape(blocks, blocksize // 2, 1)
    codes = torch.cat((pairs >> 4, pairs & 15), dim=-1).int()
    values = code[codes] * absmax.reshape(blocks, 1, 1)
    return values.reshape(shape).to(dtype)


def dequantized(module: Any, dtype: Any) -> Any:
    """The weight of a ``Linear4bit`` that :func:`inline_4bit` prepared, in ``dtype``."""
    return dequantize(
        module._ctrain_packed,
        module._ctrain_absmax,
        module._ctrain_code,
        module._ctrain_blocksize,
        module._ctrain_shape,
        dtype,
        module._ctrain_absmax_code,
        module._ctrain_absmax_scale,
        module._ctrain_absmax_offset,
        module._ctrain_absmax_blocksize,
    )


def _forward(self: Any, x: Any) -> Any:
    """bitsandbytes' ``Linear4bit.forward`` (compute dtype, bias cast, output back in the input's
    dtype) with the dequantisation written out for the compiler."""
    import torch.nn.functional as F

    dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)
    bias = None if self.bias is None else self.bias.to(x.dtype)
    return F.linear(x, dequantized(self, x.dtype), bias).to(dtype)


def _tensors(module: Any) -> dict[str, Any] | None:
    """The quantisation state of a ``Linear4bit`` as plain tensors, or None where this module's
    dequantisation does not cover it."""
    import torch

    weight = getattr(module, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is None or state.quant_type != "nf4" or weight.dtype != torch.uint8:
        return None
    shape = tuple(int(n) for n in state.shape)
    if len(shape) != 2 or state.absmax.numel() * state.blocksize != shape[0] * shape[1]:
        return None
    if 2 * weight.numel() != shape[0] * shape[1] or state.code.numel() != 16:
        return None
    plain = {
        "packed": weight.data.as_subclass(torch.Tensor),
        "absmax": state.absmax,
        "code": state.code,
        "absmax_code": None,
        "absmax_scale": None,
        "absmax_offset": None,
    }
    if state.nested:
        plain.update(absmax_code=state.state2.code, absmax_scale=state.state2.absmax, absmax_offset=state.offset)
        if state.offset is None or state.state2.code.numel() != 256:
            return None
        if not isinstance(state.offset, torch.Tensor):
            plain["absmax_offset"] = torch.tensor(float(state.offset), device=state.absmax.device)
    module._ctrain_shape = shape
    module._ctrain_blocksize = int(state.blocksize)
    module._ctrain_absmax_blocksize = int(state.state2.blocksize) if state.nested else 0
    return plain


def inline_4bit(model: Any) -> int:
    """Dequantise every bitsandbytes ``Linear4bit`` of ``model`` in its own forward (see the module's
    docstring); returns how many. Before compiling: the compiled layers trace the new forward."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, Linear4bit) or getattr(module, "_ctrain_packed", None) is not None:
            continue
        tensors = _tensors(module)
        if tensors is None:
            continue
        for name in _BUFFERS:
            module.register_buffer(f"_ctrain_{name}", tensors[name], persistent=False)
        cls = type(module)
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": _forward, "__module__": cls.__module__})
        module.__class__ = _SUBCLASSES[cls]
        count += 1
    return count
