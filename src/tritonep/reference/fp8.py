"""FP8 (e4m3) quantization per group of 128 channels: the exact rule every kernel must match.

For each token and each group of ``group_size`` consecutive channels (the last group holds the
channels left over when ``H`` is not a multiple of ``group_size``, e.g. 64 of gpt-oss's 2880):

1. ``amax = max(|x|)`` over the group's channels, computed in float32, then raised to at least
   :data:`AMAX_FLOOR`. The floor is what keeps an all-zero group at zero: its scale is tiny but
   positive, so ``0 / scale == 0`` instead of ``0 / 0 == NaN``. A partial last group takes its
   ``amax`` over its own channels, as if zero-padded to a full group (zeros never raise a
   maximum of magnitudes; DeepEP's ``per_token_cast_to_fp8`` pads so).
2. ``scale = amax / 448`` (IEEE float32 division). With ``use_ue8m0`` the scale is rounded *up*
   to a power of two, ``2 ** ceil(log2(scale))``, computed exactly from the float's exponent
   (no ``log2`` rounding), so that it fits an 8-bit exponent-only (UE8M0) encoding.
3. ``q = e4m3(clamp(x / scale, -448, 448))``: IEEE float32 division, then round-to-nearest-even
   into ``torch.float8_e4m3fn``. Clamping first matters: torch turns values above 448 into NaN.

De-quantization is ``q.float() * scale``. Scales are returned as float32
``[..., ceil(H / group_size)]``. A group that holds NaN gets a NaN scale and de-quantizes to
NaN: bad values stay visible.

Power-of-two scales can also travel packed, as DeepEP's ``use_ue8m0`` returns them: each scale
is its float32 exponent byte (UE8M0: ``2 ** (byte - 127)``), four to an int32, group ``g`` in
byte ``g % 4`` (little-endian) of int32 ``g // 4`` (:func:`pack_ue8m0`, :func:`unpack_ue8m0`):
``ceil(ceil(H / 128) / 4)`` int32 columns.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
GROUP_SIZE = 128


def round_scale_to_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Round positive float32 scales up to the next power of two (exact; powers stay put).
    Infinite and NaN scales stay what they are."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.where(scale.isfinite(), torch.ldexp(torch.ones_like(scale), exponent), scale)


def num_groups(hidden: int, group_size: int = GROUP_SIZE) -> int:
    """Scales per token of ``hidden`` channels: ``ceil(hidden / group_size)``."""
    return -(-hidden // group_size)


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x[..., H]`` as float32 ``[..., ceil(H / group_size), group_size]``, the last group
    zero-padded."""
    hidden = x.shape[-1]
    padded = torch.nn.functional.pad(
        x.float(), (0, num_groups(hidden, group_size) * group_size - hidden)
    )
    return padded.unflatten(-1, (-1, group_size))


def _per_channel(scale: torch.Tensor, hidden: int, group_size: int) -> torch.Tensor:
    """Group scales ``[..., G]`` spread over their channels: float32 ``[..., hidden]``."""
    return scale.float().repeat_interleave(group_size, dim=-1)[..., :hidden]


def fp8_scales(x: torch.Tensor, group_size: int = GROUP_SIZE, use_ue8m0: bool = False):
    """Per-group scales of ``x[..., H]``: float32 ``[..., ceil(H / group_size)]``."""
    amax = _groups(x, group_size).abs().amax(dim=-1)
    amax = torch.where(torch.isnan(amax), amax, amax.clamp_min(AMAX_FLOOR))
    # Divide by a tensor, not a Python scalar: on CUDA, torch turns division by a scalar into
    # multiplication by its reciprocal, which rounds differently from IEEE division.
    scale = amax / torch.full_like(amax, FP8_MAX)
    if use_ue8m0:
        scale = round_scale_to_pow2(scale)
    return scale


def quantize_fp8(x: torch.Tensor, group_size: int = GROUP_SIZE, use_ue8m0: bool = False):
    """Quantize ``x[..., H]`` (any float dtype) to
    ``(e4m3 [..., H], f32 scales [..., ceil(H / g)])``."""
    scale = fp8_scales(x, group_size, use_ue8m0)
    divisor = _per_channel(scale, x.shape[-1], group_size)
    q = (x.float() / divisor).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, group_size: int = GROUP_SIZE):
    """Inverse of :func:`quantize_fp8` up to rounding: float32 ``[..., H]``."""
    return q.float() * _per_channel(scale, q.shape[-1], group_size)


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``[..., G]`` -> int32 ``[..., ceil(G / 4)]`` of exponent
    bytes (group ``g`` in byte ``g % 4`` of int32 ``g // 4``; missing groups' bytes zero)."""
    exponents = (scale.float().contiguous().view(torch.int32) >> 23) & 0xFF
    groups = scale.shape[-1]
    padded = torch.zeros(*scale.shape[:-1], -(-groups // 4) * 4, dtype=torch.uint8,
                         device=scale.device)  # fmt: skip
    padded[..., :groups] = exponents.to(torch.uint8)
    return padded.view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """Int32 ``[..., ceil(groups / 4)]`` of UE8M0 exponent bytes (any strides) -> the float32
    scales ``[..., groups]``."""
    dense = torch.empty_like(packed, memory_format=torch.contiguous_format).copy_(packed)
    exponents = dense.view(torch.uint8)[..., :groups].to(torch.int32)
    return (exponents << 23).view(torch.float32)
