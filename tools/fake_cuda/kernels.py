"""CUDA-only kernels, run on the host with CUDA's contract: the checks CUDA's kernels make that a meta kernel
cannot (data pointers, the kernel's own shape rules), the values computed by torch's CPU kernels, and the
outputs in CUDA's shapes (the memory-efficient attention's log-sum-exp padded to 32 rows, the padding not a
number, so code that reads it computes NaN as it would compute garbage on a GPU). Layouts (strides) follow
torch's meta kernels for every operation (session.py), these included.

Sources: aten/src/ATen/native/transformers/cuda/attention.cu and attention_backward.cu
(`_efficient_attention_forward` / `_backward`: equal head counts, last dimension contiguous, the log-sum-exp
padded to kAlignLSE = 32 rows and read back through its strides), flash_api.cpp (`mha_fwd`: fp16/bf16 only, head
dimension a multiple of 8 and at most 256, key/value heads dividing the query heads), and
aten/src/ATen/native/GroupedMMUtils.h (`_grouped_mm`: every operand's data pointer 16-byte aligned); CUDA's
histc, which counts integers too."""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten
LSE_ALIGN = 32  # the memory-efficient kernel's kAlignLSE


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _last_contiguous(*tensors) -> None:
    for t in tensors:
        _require(t.stride(-1) == 1, f"CUDA attention: a {list(t.shape)} operand's last dimension is not contiguous")


def _host_attention(q, k, v, causal, scale, groups=1):
    """Values and log-sum-exp [b, h, m] from torch's CPU flash kernel (k and v expanded for grouped heads)."""
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _host_attention_backward(grad, q, k, v, out, lse, causal, scale, groups=1):
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.contiguous(), q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale
    )
    if groups > 1:
        dk, dv = (t.unflatten(1, (-1, groups)).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _efficient_checks(q, k, v):
    _require(q.dim() == k.dim() == v.dim() == 4, "memory-efficient attention: q, k, v must be 4-D [b, h, s, d]")
    _require(q.shape[0] == k.shape[0] == v.shape[0], "memory-efficient attention: batch sizes differ")
    _require(k.shape[2] == v.shape[2], "memory-efficient attention: key and value lengths differ")
    _require(
        q.shape[1] == k.shape[1] == v.shape[1],
        f"memory-efficient attention: {q.shape[1]} query heads, {k.shape[1]} key and {v.shape[1]} value heads "
        "(the kernel takes equal head counts; expand grouped key/value heads first)",
    )
    _require(q.shape[3] == k.shape[3], "memory-efficient attention: query and key head dimensions differ")
    _last_contiguous(q, k, v)


def efficient_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    _efficient_checks(q, k, v)
    _require(attn_bias is None and dropout_p == 0.0, "fake CUDA: this stand-in takes no bias or dropout")
    out, lse = _host_attention(q, k, v, is_causal, scale)
    b, h, m = lse.shape
    padded = lse.new_full((b, h, math.ceil(m / LSE_ALIGN) * LSE_ALIGN if compute_log_sumexp else 0), float("nan"))
    if compute_log_sumexp:
        padded[..., :m] = lse
    seed = offset = torch.zeros((), dtype=torch.int64)  # host scalars, as CUDA returns them outside graph capture
    return out, padded, seed, offset


def efficient_attention_backward(
    grad, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None
):
    _efficient_checks(q, k, v)
    m = q.shape[2]
    fits = lse.dim() == 3 and lse.shape[:2] == q.shape[:2] and lse.shape[2] >= m and lse.stride(2) == 1
    _require(fits, f"memory-efficient backward: log-sum-exp {list(lse.shape)} for {m} queries")
    dq, dk, dv = _host_attention_backward(grad, q, k, v, out, lse[..., :m], is_causal, scale)
    return dq, dk, dv, None


def _flash_checks(q, k, v):
    half = q.dtype in (torch.float16, torch.bfloat16)
    _require(half, f"FlashAttention only supports fp16 and bf16 data type, not {q.dtype}")
    _require(q.dtype == k.dtype == v.dtype, "FlashAttention: query, key and value must have the same dtype")
    _require(q.shape[-1] % 8 == 0 and q.shape[-1] <= 256, f"FlashAttention: head dimension {q.shape[-1]}")
    _require(
        q.shape[1] % k.shape[1] == 0 and k.shape[1] == v.shape[1],
        "FlashAttention: the number of heads in key/value must divide the number of heads in query",
    )
    _last_contiguous(q, k, v)


def flash_attention(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    _flash_checks(q, k, v)
    _require(dropout_p == 0.0 and not return_debug_mask, "fake CUDA: the flash stand-in takes no dropout")
    out, lse = _host_attention(q, k, v, is_causal, scale, q.shape[1] // k.shape[1])
    seed = torch.zeros(2, dtype=torch.uint64)
    offset = torch.zeros((), dtype=torch.uint64)
    return out, lse.float(), None, None, q.shape[2], k.shape[2], seed, offset, q.new_empty(0)


def flash_attention_backward(
    grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *, scale=None
):
    _flash_checks(q, k, v)
    _require(list(lse.shape) == [*q.shape[:3]], f"FlashAttention backward: log-sum-exp {list(lse.shape)}")
    return _host_attention_backward(grad, q, k, v, out, lse, is_causal, scale, q.shape[1] // k.shape[1])


def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """CUDA's _grouped_mm (GroupedBlas.cpp, GroupedMMUtils.h): bf16, fp16 or fp32 (torch's meta kernel still
    says bf16 only); every operand 16-byte aligned, in its start and in its leading stride; int32 offsets."""
    _require(
        mat_a.dtype == mat_b.dtype and mat_a.dtype in (torch.bfloat16, torch.float16, torch.float32),
        f"grouped_mm: operands must be bf16, fp16 or fp32 of one dtype, not {mat_a.dtype} and {mat_b.dtype}",
    )
    _require(offs is None or offs.dtype == torch.int32, f"grouped_mm: offsets must be int32, not {offs.dtype}")
    for name, t in (("mat_a", mat_a), ("mat_b", mat_b)):
        _require(
            t.data_ptr() % 16 == 0,
            f"expected data_ptr to be aligned to 16 bytes ({name} {list(t.shape)} starts {t.data_ptr() % 16} bytes "
            "past a 16-byte boundary)",
        )
        leading = t.stride(-2) if t.stride(-1) == 1 else t.stride(-1)
        _require(leading * t.element_size() % 16 == 0, f"grouped_mm: {name}'s strides {t.stride()} are not 16-byte")
    return aten._grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)


def _grouped_mm_syncs(mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> str | None:
    fast = mat_a.dtype == mat_b.dtype == torch.bfloat16 and out_dtype in (None, torch.bfloat16)
    return None if fast else "the grouped matrix multiply's fallback (not bf16) reading its offsets on the host"


def histc(x, bins=100, min=0, max=0):  # noqa: A002 (aten's names)
    """CUDA's histc takes integer inputs (Transformers' grouped experts count routes with it); the CPU kernel
    only floating ones. The counts are exact in float64, and come back in the input's dtype as on CUDA."""
    if x.is_floating_point():
        return aten.histc.default(x, bins, min, max)
    return aten.histc.default(x.double(), bins, min, max).to(x.dtype)


# op -> its stand-in; the session runs these instead of the CPU kernel when an operand is on a fake GPU
STAND_INS = {
    aten._scaled_dot_product_efficient_attention.default: efficient_attention,
    aten._scaled_dot_product_efficient_attention_backward.default: efficient_attention_backward,
    aten._scaled_dot_product_flash_attention.default: flash_attention,
    aten._scaled_dot_product_flash_attention_backward.default: flash_attention_backward,
    aten._grouped_mm.default: grouped_mm,
    aten.histc.default: histc,
}
# stand-ins that apply CUDA's rules themselves, where torch's meta kernel is out of date: the session checks
# only the device rule for them; and what makes the host wait in CUDA's implementation of them
OWN_RULES = {aten._grouped_mm.default: _grouped_mm_syncs}
