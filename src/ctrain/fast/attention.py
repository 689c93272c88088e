"""Document-masked attention for packed, padding-free batches, through PyTorch's own kernels.

Packing several examples into one row only trains correctly when no example attends to another.
TRL's padding-free collator already hands the model the sequence boundaries (``cu_seq_lens_q``,
``max_length_q``, ...); the attention function registered here passes them to PyTorch's
variable-length flash attention (the kernel behind ``torch.nn.attention.varlen``), so no
``flash-attn`` package, no Hub kernel download and no ``T x T`` mask are needed. Batches that
carry a padding mask instead (evaluation, generation) go to transformers' SDPA path unchanged.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "ctrain_varlen"


@torch.compiler.disable
def reference_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal attention within each document of a flattened ``(tokens, heads, dim)`` batch, one SDPA call each.

    The plain definition that the fused kernel must match; also the path on CPU and in float32.
    Never compiled: its loop over documents would specialise every graph on the batch's lengths.
    """
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    rep = q.shape[1] // k.shape[1]
    for start, end in itertools.pairwise(bounds):
        if end == start:
            continue
        qd, kd, vd = (t[start:end].transpose(0, 1) for t in (q, k, v))
        if rep > 1:
            kd, vd = kd.repeat_interleave(rep, 0), vd.repeat_interleave(rep, 0)
        out[start:end] = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale).transpose(0, 1)
    return out


def fused_available(q: torch.Tensor) -> bool:
    """Whether PyTorch's flash kernel takes this tensor (CUDA, half precision; meta for tracing)."""
    return q.dtype in (torch.bfloat16, torch.float16) and (q.is_cuda or q.is_meta)


def varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each document; ``q``/``k``/``v`` are ``(tokens, heads, dim)``.

    On CUDA in bf16/fp16 this is PyTorch's flash-attention varlen kernel, called as the aten op
    that ``torch.nn.attention.varlen.varlen_attn`` wraps: the op has its own autograd formula and
    compiles as a plain extern kernel, while the public wrapper is a Python custom op whose
    dispatch took ~0.3 ms of CPU per call, forward and backward, in every layer (profiled on an
    H100), where the step is bound by CPU launch overhead. The kernel takes fewer K/V heads
    than query heads as they are (GQA).
    Elsewhere, the reference loop.
    """
    if not fused_available(q):
        return reference_varlen(q, k, v, cu_seqlens, scale)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)
    return out[0]


def _cu_seqlens_from_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document boundaries of a single packed row whose positions restart at 0 (None if one document)."""
    starts = (position_ids[0] == 0).nonzero().flatten()
    if starts.numel() <= 1:
        return None
    end = torch.tensor([position_ids.shape[1]], device=starts.device)
    return torch.cat([starts, end]).to(torch.int32)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function: varlen for packed rows, SDPA for everything else."""
    batch, _, q_len, _ = query.shape
    cu = kwargs.get("cu_seq_lens_q")
    packed = attention_mask is None and batch == 1 and q_len == key.shape[2] and q_len > 1
    if packed and cu is None and kwargs.get("position_ids") is not None:
        cu = _cu_seqlens_from_positions(kwargs["position_ids"])
    if not packed or cu is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout:
        raise ValueError(f"{NAME} attention has no dropout; set the model's attention_dropout to 0")
    max_len = kwargs.get("max_length_q")
    if max_len is None:
        max_len = int(cu.diff().max())
    elif isinstance(max_len, torch.Tensor):
        max_len = int(max_len)
    dtype = query.dtype
    if dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
    # (1, heads, tokens, dim) -> (tokens, heads, dim): a view of the projection's output, no copy.
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out = varlen(q, k, v, cu, max_len, scale)
    return out.unsqueeze(0), None


def _mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """No mask for padding-free rows (the boundaries travel as ``cu_seq_lens``); SDPA's mask otherwise."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Make ``attn_implementation="ctrain_varlen"`` known to transformers; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME


def self_check(device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, float]:
    """Relative error of the fused varlen kernel against the per-document reference (float32), output and grads.

    Random documents of uneven length, one packed row; the reference runs on upcast copies.
    """
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 700, (9,), generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    heads, kv_heads, dim = 8, 4, 64
    total = int(cu[-1])
    q, k, v = (
        torch.randn(total, h, dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(total, heads, dim, generator=gen).to(device=device, dtype=dtype)
    out = varlen(q, k, v, cu.to(device), int(lens.max()))
    out.backward(grad)
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref = reference_varlen(*ref_in, cu)
    ref.backward(grad.double().cpu())

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        b = b.detach()
        return float((a.detach().double().cpu() - b).norm() / b.norm())

    errors = {"out": rel(out, ref)}
    for name, t, r in zip("qkv", (q, k, v), ref_in):
        errors[f"grad_{name}"] = rel(t.grad, r.grad)
    errors["fused"] = float(fused_available(q))
    return errors
