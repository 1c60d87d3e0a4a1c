"""LogFMT-10 encoding of BF16 rows for a ``use_logfmt`` low-latency combine, and decoding.

The rule is :mod:`tritonep.reference.logfmt`. A row's slot in the combine receive buffer
keeps its BF16 layout, 256 bytes per 128-channel group, so a group sent unchanged is an
ordinary BF16 store; an encoded group fills the first 160 bytes of its 256: the low 8 bits
of each channel's 9-bit code (128 bytes), then the code's ninth bit and the sign, two bits
a channel, four channels a byte (32 bytes). After the payload, the slot holds each group's
``(log_amin, step)`` as float32 pairs; ``step == 0`` marks a group sent unchanged.

What it costs: an encoded row moves 168 of 256 bytes per group, but a sender spends about
20 instructions a channel encoding it, so one program per SM is bound by instructions, not
bytes: on NVLink a LogFMT combine takes about 2.5 times a BF16 one (BENCHMARKS.md, "LogFMT
combine"); it pays where bytes are dear (across nodes). What keeps it that cheap: whole
rows per step on 16 warps (few, large steps hide the load latency), channels contiguous in
registers (16-byte loads, group reductions within a warp: no shared memory), the hardware's
approximate logarithm (as DeepEP's), and no per-channel work that the clamps make
redundant.
"""

from __future__ import annotations

import triton
import triton.language as tl

CODE_MAX = tl.constexpr(511)
MIN_CLIP = tl.constexpr(32.0)


@triton.jit
def fast_log2(x, EMULATE: tl.constexpr):
    """``log2`` of positive float32 values: the hardware's approximation on GPUs (one
    special-function instruction, relative error below 2**-22; the exact routine is a long
    dependent chain that the few warps of a program cannot hide), ``tl.log2`` under the
    interpreter (``EMULATE``)."""
    if EMULATE:
        return tl.log2(x)
    else:
        return tl.inline_asm_elementwise(
            "lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def encode_groups(y, valid, PARTIAL: tl.constexpr, EMULATE: tl.constexpr):
    """Groups of 128 channels, float32 ``y [R, G, 128]`` -> ``(encoded [R, G] bool, low code
    bytes [R, G, 128] uint8, high [R, G, 32] uint8 (code bit 8 | sign << 1 of channels
    4 q + j at bits 2 j), log_amin [R, G], step [R, G])`` (``step`` 0 and codes 0 where a
    group goes unchanged).

    With ``PARTIAL`` (a hidden size that is not a multiple of 128) the channels off in
    ``valid`` (broadcast to ``y``'s shape) are missing ones, loaded as zeros: a group's
    smallest magnitude is taken over its real channels alone (zeros leave the largest and
    the sum as they are).

    Channels stay contiguous so that the loads are 16-byte vectors and every group
    reduction stays within a warp (registers and shuffles, no shared memory or barrier);
    the four channels whose high bits share a byte are neighbours in one thread.
    """
    a = tl.abs(y)
    # NaN in a group makes its sum NaN; Inf makes its amax >= 1: both groups go unchanged.
    total = tl.sum(a, axis=2)
    amax = tl.max(a, axis=2)
    if PARTIAL:
        amin = tl.min(tl.where(valid, a, float("inf")), axis=2)
    else:
        amin = tl.min(a, axis=2)
    # Logarithms of zero (all-zero or clipped groups) are only taken where the result is
    # used; the where()s keep the interpreter's numpy quiet.
    log_amax = fast_log2(tl.where(amax > 0, amax, 1.0), EMULATE)
    log_amin = fast_log2(tl.where(amin > 0, amin, 1.0), EMULATE)
    log_amin = tl.where(amin > 0, log_amin, log_amax - MIN_CLIP)
    log_amin = tl.maximum(log_amin, log_amax - MIN_CLIP)
    encoded = (log_amax < 0) & (log_amin < log_amax) & (total == total)  # all-zero: log_amax 0
    step = tl.where(encoded, (log_amax - log_amin) / (CODE_MAX - 1), 0.0)
    encoded = encoded & (step > 0)
    safe = tl.where(encoded, step, 1.0)
    low_log = tl.where(encoded, log_amin, 0.0)
    inv = 1.0 / safe
    # Code c + 1 from the midpoint of the values of c and c + 1 up (the reference's offset).
    midpoint = fast_log2((1.0 + tl.exp2(safe)) * 0.5, EMULATE)
    offset = 2.0 - midpoint * inv - low_log * inv
    # Per channel, the fewest instructions (encoding is bound by them): log2(0) = -inf gives
    # code 0 through the clamp at 0, truncation is floor for values >= 0, the sign is the
    # float's top bit, and codes of groups that go unchanged are computed but never stored.
    if EMULATE:
        taken = (a > 0) & encoded[:, :, None]
        log_a = tl.where(taken, tl.log2(tl.where(taken, a, 1.0)), float("-inf"))
    else:
        log_a = fast_log2(a, EMULATE)
    code = tl.maximum(log_a * inv[:, :, None] + offset[:, :, None], 0.0).to(tl.int32)
    code = tl.minimum(code, CODE_MAX)
    high = (code >> 8) | ((y.to(tl.int32, bitcast=True) >> 30) & 2)
    # Disjoint bit fields: their sum is the packed byte.
    shift = (tl.arange(0, 128) % 4) * 2
    R: tl.constexpr = y.shape[0]
    G: tl.constexpr = y.shape[1]
    packed = tl.sum(tl.reshape(high << shift[None, None, :], (R, G, 32, 4)), axis=3)
    return encoded, code.to(tl.uint8), packed.to(tl.uint8), low_log, step


@triton.jit
def decode(low, high, log_amin, step):
    """Channels' float32 values from their low code bytes and their two high bits (code bit
    8, sign), with their group's parameters (all broadcast to one shape)."""
    code = low.to(tl.int32) | ((high & 1) << 8)
    magnitude = tl.where(code > 0, tl.exp2((code - 1).to(tl.float32) * step + log_amin), 0.0)
    return tl.where(high >= 2, -magnitude, magnitude)
