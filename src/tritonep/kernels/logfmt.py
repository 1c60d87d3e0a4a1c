"""LogFMT-10 encoding of BF16 rows for a ``use_logfmt`` low-latency combine, and decoding.

The rule is :mod:`tritonep.reference.logfmt`. A row's slot in the combine receive buffer
keeps its BF16 layout, 256 bytes per 128-channel group, so a group sent unchanged is an
ordinary BF16 store; an encoded group fills the first 160 bytes of its 256: the low 8 bits
of each channel's 9-bit code (128 bytes), then the code's ninth bit and the sign, two bits
a channel, four channels a byte (32 bytes). After the payload, the slot holds each group's
``(log_amin, step)`` as float32 pairs; ``step == 0`` marks a group sent unchanged.

What it costs: an encoded row moves 168 of 256 bytes per group, but encoding is a chain of
dependent steps per chunk (load, group reductions, logarithms, stores) that one program of
a few warps per SM cannot overlap, so on NVLink it costs more time than it saves
(BENCHMARKS.md, "LogFMT combine"); it pays where bytes are dear (across nodes). The four
channels whose high bits share a byte are handled by one thread (four phase tensors) and
the logarithm is the hardware's approximation, as DeepEP's.
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
def _code(y, inv, offset, encoded, EMULATE: tl.constexpr):
    """Channels ``y [R, G, 32]`` -> (low code byte, high bits: code bit 8 | sign << 1)."""
    a = tl.abs(y)
    nonzero = (a > 0) & encoded[:, :, None]
    log_a = fast_log2(tl.where(nonzero, a, 1.0), EMULATE)
    code = tl.floor(tl.maximum(log_a * inv[:, :, None] + offset[:, :, None], 0.0))
    code = tl.where(nonzero, tl.minimum(code, CODE_MAX), 0.0).to(tl.int32)
    return (code & 0xFF).to(tl.uint8), (code >> 8) | ((y < 0).to(tl.int32) << 1)


@triton.jit
def encode_groups(y0, y1, y2, y3, EMULATE: tl.constexpr):
    """Groups of 128 channels, as four float32 ``[R, G, 32]`` phases (``y_j[:, g, q]`` is
    channel ``4 q + j`` of group ``g``) -> ``(encoded [R, G] bool, four low code bytes
    [R, G, 32] uint8, high [R, G, 32] uint8, log_amin [R, G], step [R, G])`` (``step`` 0
    and codes 0 where a group goes unchanged).

    The four channels whose high bits share a byte are the same element of four tensors,
    so packing them is elementwise: no data moves between threads but the group reductions.
    """
    a0, a1, a2, a3 = tl.abs(y0), tl.abs(y1), tl.abs(y2), tl.abs(y3)
    odd = (a0 != a0) | (a0 == float("inf")) | (a1 != a1) | (a1 == float("inf"))
    odd = odd | (a2 != a2) | (a2 == float("inf")) | (a3 != a3) | (a3 == float("inf"))
    special = tl.max(odd.to(tl.int32), axis=2) > 0
    amax = tl.max(tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3)), axis=2)
    amin = tl.min(tl.minimum(tl.minimum(a0, a1), tl.minimum(a2, a3)), axis=2)
    # Logarithms of zero (all-zero or clipped groups) are only taken where the result is
    # used; the where()s keep the interpreter's numpy quiet.
    log_amax = fast_log2(tl.where(amax > 0, amax, 1.0), EMULATE)
    log_amin = fast_log2(tl.where(amin > 0, amin, 1.0), EMULATE)
    log_amin = tl.where(amin > 0, log_amin, log_amax - MIN_CLIP)
    log_amin = tl.maximum(log_amin, log_amax - MIN_CLIP)
    encoded = (log_amax < 0) & (log_amin < log_amax) & ~special  # all-zero: log_amax 0
    step = tl.where(encoded, (log_amax - log_amin) / (CODE_MAX - 1), 0.0)
    encoded = encoded & (step > 0)
    safe = tl.where(encoded, step, 1.0)
    low_log = tl.where(encoded, log_amin, 0.0)
    inv = 1.0 / safe
    # Code c + 1 from the midpoint of the values of c and c + 1 up (the reference's offset).
    midpoint = fast_log2((1.0 + tl.exp2(safe)) * 0.5, EMULATE)
    offset = 2.0 - midpoint * inv - low_log * inv
    low0, high0 = _code(y0, inv, offset, encoded, EMULATE)
    low1, high1 = _code(y1, inv, offset, encoded, EMULATE)
    low2, high2 = _code(y2, inv, offset, encoded, EMULATE)
    low3, high3 = _code(y3, inv, offset, encoded, EMULATE)
    packed = high0 | (high1 << 2) | (high2 << 4) | (high3 << 6)
    return encoded, low0, low1, low2, low3, packed.to(tl.uint8), low_log, step


@triton.jit
def decode(low, high, log_amin, step):
    """Channels' float32 values from their low code bytes and their two high bits (code bit
    8, sign), with their group's parameters (all broadcast to one shape)."""
    code = low.to(tl.int32) | ((high & 1) << 8)
    exponent = tl.where(code > 0, (code - 1).to(tl.float32) * step + log_amin, 0.0)
    magnitude = tl.where(code > 0, tl.exp2(exponent), 0.0)
    return tl.where(high >= 2, -magnitude, magnitude)
