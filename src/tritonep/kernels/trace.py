"""Kernel traces and wait statistics: timer readings taken inside the kernels.

A traced launch gets an int64 buffer of ``SLOTS`` words per program plus one: each program
writes when it started, when its send phase ended and when it finished, then the time it spent
in each of up to five sub-phases (summed over its work items, since sub-phases interleave),
and the SM it ran on (programs of one launch share an SM's neighbours, its TPC and GPC, by
where the hardware places them; a trace shows whether the slow ones share a place).
The host turns that into a Chrome trace (:mod:`tritonep.modes.trace`).

Both features hang on ``tl.constexpr`` flags (``PROFILE``, ``WAIT_STATS``): when off, no
clock is read and nothing is stored, so the compiled kernel is the untraced one.

On GPUs the clock is the nanosecond ``globaltimer``. The Triton interpreter has none, so there
the clock is logical: every reading takes the next value of a counter kept in the buffer's
last word (the trace then shows order, not time).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Words per program: start, send end, end, five sub-phase totals, then the SM (-1: unknown).
SLOTS = tl.constexpr(9)
START = tl.constexpr(0)
SEND_END = tl.constexpr(1)
END = tl.constexpr(2)
FIRST_PHASE = tl.constexpr(3)
SM = tl.constexpr(8)


@triton.jit
def read_clock(trace_ptr, USE_CLOCK: tl.constexpr):
    """Now, in ns (GPU) or logical ticks (interpreter; needs a trace buffer)."""
    if USE_CLOCK:
        return tl.extra.cuda.globaltimer().to(tl.int64)
    else:
        return tl.atomic_add(trace_ptr + tl.num_programs(0) * SLOTS, 1).to(tl.int64)


@triton.jit
def write_trace(trace_ptr, start, send_end, end, p0, p1, p2, p3, p4, USE_CLOCK: tl.constexpr):
    """Store one program's readings, sub-phase totals and SM (on GPUs)."""
    row = trace_ptr + tl.program_id(0) * SLOTS
    if USE_CLOCK:
        tl.store(row + SM, tl.extra.cuda.smid().to(tl.int64))
    else:
        tl.store(row + SM, -1)
    tl.store(row + START, start)
    tl.store(row + SEND_END, send_end)
    tl.store(row + END, end)
    tl.store(row + FIRST_PHASE, p0)
    tl.store(row + FIRST_PHASE + 1, p1)
    tl.store(row + FIRST_PHASE + 2, p2)
    tl.store(row + FIRST_PHASE + 3, p3)
    tl.store(row + FIRST_PHASE + 4, p4)


@triton.jit
def trace_role(trace_ptr, start, end, SENDS, waited, USE_CLOCK: tl.constexpr):
    """One program's span for kernels whose programs either send or receive (normal mode):
    a sender's span is its send phase, a receiver's its receive phase, each split into two
    sub-phases: the time it ``waited`` (for ring space, rows, tails) and the rest."""
    send_end = tl.where(SENDS, end, start)
    busy = end - start - waited
    zero = tl.zeros((), tl.int64)
    write_trace(
        trace_ptr,
        start,
        send_end,
        end,
        tl.where(SENDS, waited, zero),
        tl.where(SENDS, busy, zero),
        tl.where(SENDS, zero, waited),
        tl.where(SENDS, zero, busy),
        zero,
        USE_CLOCK,
    )
