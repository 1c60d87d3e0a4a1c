"""FP8 e4m3 quantization per 128 channels, bit-exact with the reference rule.

Any hidden size: a row is ``ceil(H / 128)`` groups, the last one partial when ``H`` is not a
multiple of 128 (loaded with its missing channels as zeros, which leave its ``amax`` as it is).

:func:`quantize_groups` quantizes one token inside a kernel (the low-latency dispatch does it on
the fly); :func:`quantize_fp8` is the same as a launch over a batch of tokens, for the normal
mode's FP8 input (one read of ``x``, one write of the payload and the scales), and
:func:`dequantize_fp8` the way back for received rows (``e4m3 * scale``, rounded once to the
output dtype).

The rule is :mod:`tritonep.reference.fp8`: ``amax`` floored at 1e-4, ``scale = amax / 448``
(IEEE division, ``div_rn``; Triton's ``/`` is an approximate division on GPUs), optionally
rounded up to a power of two by bit manipulation, ``q = e4m3(clamp(x / scale))`` with
round-to-nearest-even. NaN stays NaN: a group holding NaN gets a NaN scale.

Why it is fast: the one division per value that the rule implies is done as a multiplication
by the group's reciprocal and one exact ``fma`` correction, which rounds the same way
(:func:`quantize_groups`). Loading and quantizing a token of hidden 7168 took 3.1 us on one
H100 with a division per value, 1.6 us this way (loading alone: 0.5-0.8 us).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..reference import fp8 as reference
from ..validation import check_tensor
from .launcher import launch

FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-4)


@triton.jit
def pow2_ceil(scale):
    """Round positive normal float32 values up to a power of two (powers stay put)."""
    bits = scale.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    exponent = tl.where((bits & 0x7FFFFF) != 0, exponent + 1, exponent)
    rounded = (exponent << 23).to(tl.float32, bitcast=True)
    return tl.where(scale == scale, rounded, scale)


@triton.jit
def quantize_groups(x, USE_UE8M0: tl.constexpr, EMULATE: tl.constexpr = False):
    """``x``: float32 ``[G, 128]`` -> (values to store as e4m3 ``[G, 128]``, scales ``[G]``).

    Padding groups (all zeros) get the floor scale and zero values; padding channels of a
    partial group must be zeros (they then change nothing).

    The quotients ``x / scale`` round as IEEE division does without a division per value: one
    IEEE reciprocal ``y`` per group, ``q = x * y``, then one correction by the exact residual,
    ``fma(fma(-q, scale, x), y, q)``: the correctly rounded quotient whenever ``y`` is
    (Markstein's theorem; the GPU's division runs the same tail, but per value behind its own
    reciprocal refinement and a range check whose branch keeps values from overlapping).
    Where the theorem's range ends the e4m3 code cannot change: quotients below 2**-126 round
    to zero either way. An infinite scale (an infinite value in the group) gives ``x * 0``,
    which is ``x / inf``; zeros keep their sign. The Triton interpreter's ``fma`` rounds twice,
    so under it (``EMULATE``) each value is divided.
    """
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    if USE_UE8M0:
        scale = pow2_ceil(scale)
    scale = tl.where(has_nan, float("nan"), scale)
    if EMULATE:
        q = tl.math.div_rn(x, scale[:, None])
    else:
        y = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
        b = scale[:, None]
        q0 = x * y
        q = tl.fma(tl.fma(-q0, b, x), y, q0)
        q = tl.where((y == 0) | (x == 0), q0, q)
    q = tl.where(q != q, q, tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))
    return q, scale


@triton.jit
def from_bf16(x, EMULATE: tl.constexpr):
    """bfloat16 -> float32, exactly.

    GPUs convert in hardware; the Triton interpreter flushes subnormals to zero, so under it
    (``EMULATE``) the bits are shifted into place instead.
    """
    if EMULATE:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def to_bf16(x, EMULATE: tl.constexpr):
    """float32 -> bfloat16 with round-to-nearest-even.

    GPUs convert in hardware; the Triton interpreter truncates instead, so under it
    (``EMULATE``) the rounding is done on the bits, which keeps CPU results bit-exact too.
    """
    if EMULATE:
        bits = x.to(tl.int32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = tl.where(x != x, bits | 0x400000, rounded)  # NaN stays a (quiet) NaN
        return ((rounded >> 16) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def e4m3_bits(q, EMULATE: tl.constexpr):
    """Encode float32 values already clamped to [-448, 448] (or NaN) as e4m3 bytes (uint8).

    Round-to-nearest-even. GPUs convert in hardware; the Triton interpreter's conversion loses
    rounding carries, so under it (``EMULATE``) the encoding is computed from the bits.
    """
    if EMULATE:
        bits = q.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        exponent = (bits >> 23) & 0xFF  # biased float32 exponent; e4m3 normals need >= 121
        full = (bits & 0x7FFFFF) | 0x800000
        shift = tl.minimum(20 + tl.maximum(121 - exponent, 0), 31)
        kept = full >> shift
        rest = full & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        kept += ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
        # A rounding carry (kept == 16) moves into the exponent field by itself.
        code = tl.where(exponent < 121, kept, ((exponent - 120) << 3) + kept - 8)
        code = tl.where(exponent == 0, 0, code)
        code = tl.where(q != q, 0x7F, code) | sign
        return code.to(tl.uint8)
    else:
        return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def quantize_fp8_kernel(x_ptr, q_ptr, scale_ptr, x_stride, H: tl.constexpr, G_P2: tl.constexpr,
                        USE_UE8M0: tl.constexpr, IS_BF16: tl.constexpr,
                        EMULATE: tl.constexpr):  # fmt: skip
    """One token per program: its ``[G, 128]`` groups, loaded once, quantized, stored."""
    G: tl.constexpr = (H + 127) // 128
    token = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, G_P2)
    offs = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + token * x_stride + offs, mask=offs < H, other=0.0)
    x = from_bf16(x, EMULATE) if IS_BF16 else x.to(tl.float32)
    q, scale = quantize_groups(x, USE_UE8M0, EMULATE)
    tl.store(q_ptr + token * H + offs, e4m3_bits(q, EMULATE), mask=offs < H)
    tl.store(scale_ptr + token * G + groups, scale, mask=groups < G)


def _check_rows(name: str, t: torch.Tensor, dtypes, batched: bool = False) -> torch.Tensor:
    """``t`` as ``[B, N, H]`` (``B`` = 1 for ``[N, H]``; ``[B, N, H]`` itself when ``batched``):
    a tensor of ``dtypes`` with ``H >= 1`` and rows of unit stride; raises TypeError/ValueError
    naming ``name``."""
    check_tensor(name, t, dtype=dtypes, contiguous=False)
    shapes = "[N, H] or [B, N, H]" if batched else "[N, H]"
    if t.dim() not in ((2, 3) if batched else (2,)) or t.shape[-1] == 0:
        raise ValueError(f"{name}: expected shape {shapes} with H >= 1, got {list(t.shape)}")
    if t.shape[-2] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected rows of unit stride (call .contiguous() first)")
    return t if t.dim() == 3 else t.unsqueeze(0)


def _launch_per_token(kernel, device: torch.device, grid: tuple, hidden: int, args: tuple,
                      **meta) -> bool:  # fmt: skip
    """Launch ``kernel`` with one program per token (``grid``) on ``device``; False (nothing
    launched) for CPU tensors outside the Triton interpreter, where the caller uses the
    reference."""
    on_gpu = device.type == "cuda"
    if not on_gpu and isinstance(kernel, triton.runtime.JITFunction):
        return False
    groups = -(-hidden // 128)
    meta.update(H=hidden, G_P2=triton.next_power_of_2(groups), EMULATE=not on_gpu,
                num_warps=4 if groups <= 16 else 8)  # fmt: skip
    with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
        launch(kernel, grid, args, meta)
    return True


def quantize_fp8(x: torch.Tensor, use_ue8m0: bool = False):
    """Quantize tokens to FP8 e4m3 with one float32 scale per 128 channels, in one launch.

    The same values as :func:`tritonep.reference.quantize_fp8` bit for bit (NaN groups get NaN
    scales and values; an infinite value makes its group's scale infinite).

    Args:
        x: ``[N, H]`` BF16, FP16 or float32, any ``H >= 1`` (a partial last group of 128
            channels gets a scale of its own, e.g. 64 channels of gpt-oss's 2880), rows of
            unit stride.
        use_ue8m0: round each scale up to a power of two (DeepEP's UE8M0 scales).

    Returns:
        ``(q, scales)``: ``q`` float8_e4m3fn ``[N, H]``, ``scales`` float32
        ``[N, ceil(H / 128)]`` (contiguous), the input that
        :meth:`tritonep.Buffer.dispatch` takes in FP8 (whose rows must be a multiple of 16
        bytes: ``H`` a multiple of 16).
    """
    _, num_tokens, hidden = _check_rows(
        "x", x, (torch.bfloat16, torch.float16, torch.float32)
    ).shape
    q = torch.empty(num_tokens, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(num_tokens, -(-hidden // 128), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return q, scales
    args = (x, q.view(torch.uint8), scales, x.stride(0))
    if not _launch_per_token(quantize_fp8_kernel, x.device, (num_tokens,), hidden, args,
                             USE_UE8M0=use_ue8m0, IS_BF16=x.dtype == torch.bfloat16):  # fmt: skip
        return reference.quantize_fp8(x, use_ue8m0=use_ue8m0)
    return q, scales


@triton.jit
def e4m3_value(code, EMULATE: tl.constexpr):
    """e4m3 bytes (uint8) -> their exact float32 values (NaN for the NaN codes).

    GPUs convert in hardware; under the interpreter (``EMULATE``) the value is built from the
    bits: ``(8 + m) * 2**(e - 10)``, or ``m * 2**-9`` for a zero exponent field.
    """
    if EMULATE:
        bits = code.to(tl.int32)
        exponent = (bits >> 3) & 0xF
        mantissa = bits & 7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
        value = tl.where((bits & 0x7F) == 0x7F, float("nan"), value)
        # The sign goes in as a bit: ``-value`` is ``0 - value`` in Triton, which loses -0.
        signed = value.to(tl.int32, bitcast=True) | ((bits & 0x80) << 24)
        return signed.to(tl.float32, bitcast=True)
    else:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def dequantize_fp8_kernel(q_ptr, scale_ptr, out_ptr, num_tokens, q_batch_stride, q_stride,
                          scale_batch_stride, scale_stride, scale_group_stride, H: tl.constexpr,
                          G_P2: tl.constexpr, TO_BF16: tl.constexpr,
                          EMULATE: tl.constexpr):  # fmt: skip
    """One token per program (axis 0: token, axis 1: batch): ``e4m3 * scale`` in float32,
    stored as the output dtype. Scales may have any strides (the low-latency dispatch returns
    them column-major per expert)."""
    token = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(1).to(tl.int64)
    groups = tl.arange(0, G_P2)
    offs = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
    code = tl.load(q_ptr + batch * q_batch_stride + token * q_stride + offs, mask=offs < H,
                   other=0)  # fmt: skip
    scale_row = scale_ptr + batch * scale_batch_stride + token * scale_stride
    scale = tl.load(scale_row + groups * scale_group_stride, mask=groups < (H + 127) // 128,
                    other=0.0)  # fmt: skip
    y = e4m3_value(code, EMULATE) * scale[:, None]
    if TO_BF16:
        y = to_bf16(y, EMULATE)
    tl.store(out_ptr + (batch * num_tokens + token) * H + offs, y, mask=offs < H)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
    """FP8 rows back to ``dtype``: ``q * scale`` per 128 channels in float32, rounded once
    (the last group may be partial: any ``H``).

    Bit-exact with ``tritonep.reference.dequantize_fp8(q, scales).to(dtype)``; one read of the
    payload and one write, where the torch operations make several passes in float32.

    Args:
        q: float8_e4m3fn ``[N, H]`` (the normal mode's received rows) or ``[B, N, H]`` (the
            low-latency dispatch's ``[E_local, R * max_tokens, H]``), any ``H >= 1``, rows of
            unit stride.
        scales: float32 ``q.shape[:-1] + [ceil(H / 128)]``, any strides (the normal mode's received
            scales, :func:`quantize_fp8`'s, or the low-latency dispatch's column-major ones).
        dtype: torch.bfloat16 (default) or torch.float32.

    Returns:
        ``q.shape`` of ``dtype``, contiguous. Low-latency rows past an expert's count hold
        whatever the receive buffer held (as ``q`` does there).
    """
    batched = _check_rows("q", q, torch.float8_e4m3fn, batched=True)
    batch, num_tokens, hidden = batched.shape
    check_tensor("scales", scales, dtype=torch.float32, shape=(*q.shape[:-1], -(-hidden // 128)),
                 device=q.device, contiguous=False)  # fmt: skip
    if dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"dtype: expected torch.bfloat16 or torch.float32, got {dtype}")
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if out.numel() == 0:
        return out
    batched_scales = scales if scales.dim() == 3 else scales.unsqueeze(0)
    args = (batched.view(torch.uint8), batched_scales, out, num_tokens, batched.stride(0),
            batched.stride(1), *batched_scales.stride())  # fmt: skip
    if not _launch_per_token(dequantize_fp8_kernel, q.device, (num_tokens, batch), hidden, args,
                             TO_BF16=dtype == torch.bfloat16):  # fmt: skip
        return reference.dequantize_fp8(q, scales).to(dtype)
    return out
