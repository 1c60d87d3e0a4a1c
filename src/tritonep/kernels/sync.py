"""Cross-rank synchronization primitives for Triton kernels, and bounded waits.

Flags live in the symmetric heap and are written with a system-scope *release* and read with a
system-scope *acquire*, so data stored before a flag is visible to whoever sees the flag.
Triton executes an atomic on a scalar pointer once per program, so each helper puts a program
barrier on the side where other threads' memory accesses must be ordered with it.

Every wait is bounded. On a GPU the deadline comes from the nanosecond ``globaltimer``; under
the Triton interpreter, which cannot read it, from the host's monotonic clock
(:func:`host_clock_ns`), so a limit there is wall time too, however slow each spin is. A wait
that gives up records (peer, phase) in a small device *status* (:mod:`tritonep.kernels.status`)
and returns ``False``; the kernel then skips the rest of its work and the host turns the status
into :class:`~tritonep.errors.WaitTimeoutError`. No kernel ever traps, so the CUDA context
survives a timeout.

A recorded timeout stays: the mode's call counters no longer agree with its peers', so the
buffer is done for. Every later launch therefore reads the status before it waits and, finding
a timeout there, polls each flag a few times (at most CLOCK_EVERY reads) instead of waiting
(:func:`limit_ns`): a dead peer costs one limit, not one per call (a CUDA graph replayed in a
loop, a decode step after the next).
The status also keeps the limit the failed wait had, so the error names it even after
``timeout_s`` changed.

The limit reaches a kernel as whole microseconds in an argument that Triton does not
specialize (:func:`timeout_us`, ``do_not_specialize``): an int32 whatever the limit, so
changing a mode's ``timeout_s`` compiles nothing. In nanoseconds, limits below 2.1 s would be
int32 and longer ones int64, and the first call after a change would compile new variants
while its peers wait on it (under a short limit, long enough to time out).
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from .status import (  # noqa: F401 - the status words and their records, named here too
    STATUS_BAD_ID,
    STATUS_OK,
    STATUS_OVERFLOW,
    STATUS_TIMEOUT,
    STATUS_WORDS,
    Status,
    check_status,
    new_status,
    raise_on_timeout,
    record_timeout,
)


def host_clock_ns() -> int:
    """The host's monotonic clock in nanoseconds: the kernels' clock under the interpreter.

    The interpreter runs a kernel as Python, so a wait loop calls this as it is; it is marked a
    Triton builtin only so that the compiler's scan of a kernel's globals accepts it, and the
    compiler never reaches it (it sits in the ``USE_CLOCK`` False branch, which GPU launches
    never take).
    """
    return time.monotonic_ns()


host_clock_ns.__triton_builtin__ = True  # type: ignore[attr-defined]

#: Default limit of every wait, in seconds.
DEFAULT_TIMEOUT_S = 100.0


@triton.jit
def aligned_ptr(addr, DTYPE: tl.constexpr):
    """A typed pointer from an int64 heap address that is a multiple of 16 bytes.

    Saying so lets Triton move data in 16-byte vectors: it cannot see the alignment of an
    address loaded from memory (the peer base addresses) by itself. Give it a record's
    address and add a field's offset to the pointer it returns: Triton rewrites the cast of
    ``address + constant`` into pointer arithmetic and drops the hint with it (the field then
    moves one element per instruction; the PTX tests of tests/test_kernels_compile.py and
    tests/test_elastic.py look for that).
    """
    return tl.multiple_of(addr.to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def load_acquire(ptr):
    """Read a flag with system-scope acquire semantics."""
    value = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    return value


@triton.jit
def store_release(ptr, value):
    """Write a flag with system-scope release semantics, after all of this program's stores."""
    tl.debug_barrier()
    tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def add_release(ptr, value):
    """Add to a counter with system-scope release semantics, after this program's stores."""
    tl.debug_barrier()
    tl.atomic_add(ptr, value, sem="release", scope="sys")


@triton.jit
def limit_ns(timeout_us, status_ptr):
    """The limit of this launch's waits in int64 nanoseconds: the kernel's ``timeout_us``
    argument (:func:`timeout_us`), or 0 (a few polls, no wait) once ``status_ptr`` holds a timeout
    of an earlier launch or of another program of this one. It costs a load: call it where
    the program's waits begin, or only once a first read found a flag not yet set (the
    low-latency dispatch, whose counts are usually all there, where a load at the start of its
    receiving part would be a visible share of a short call)."""
    failed = tl.load(status_ptr, volatile=True) == STATUS_TIMEOUT
    return tl.where(failed, 0, timeout_us.to(tl.int64) * 1000)


@triton.jit
def elapsed_ns(start, spins, USE_CLOCK: tl.constexpr):
    """Nanoseconds since ``start`` (:func:`start_clock`). ``spins`` (the loop's count of
    reads) is unused: both clocks are wall time."""
    if USE_CLOCK:
        return tl.extra.cuda.globaltimer() - start
    else:
        return tl.full((), host_clock_ns(), tl.int64) - start


@triton.jit
def start_clock(USE_CLOCK: tl.constexpr):
    if USE_CLOCK:
        return tl.extra.cuda.globaltimer()
    else:
        return tl.full((), host_clock_ns(), tl.int64)


#: Lanes of the reduction that gives every thread of a program one answer: a block of at least
#: one lane a thread for the largest launch (32 warps), so that it spans every warp.
_PROGRAM_LANES = tl.constexpr(1024)
#: A wait on a GPU compares the clock with its limit once every this many reads (a power of 2).
CLOCK_EVERY = tl.constexpr(16)


@triton.jit
def keep_waiting(done, start, limit, spins, USE_CLOCK: tl.constexpr):
    """Whether a wait goes on: ``done`` does not hold and ``limit`` nanoseconds have not
    passed since ``start`` (:func:`start_clock`), one answer for every thread of the program.

    ``done`` and ``spins`` (the reads since the wait began, or since the loop last made
    progress and restarted its clock) must already be the same on every thread: a flag read
    by an atomic, which one thread makes and all receive. Each thread reads its own clock, and
    near the limit they disagree; reduced over a block spanning every warp, the clock gives
    them one answer, so they leave the wait at the same read and the barriers after it stay
    in step. On a GPU the clock is compared once every CLOCK_EVERY reads, so each read bears
    a sixteenth of the reduction, and a wait that finds its flag at once, or a loop that keeps
    moving rows, none of it."""
    going = not done
    if USE_CLOCK:
        if going & ((spins & (CLOCK_EVERY - 1)) == CLOCK_EVERY - 1):
            late = (tl.extra.cuda.globaltimer() - start >= limit).to(tl.int32)
            going = tl.max(tl.full((_PROGRAM_LANES,), 0, tl.int32) + late, 0) == 0
    else:
        going = going & (tl.full((), host_clock_ns(), tl.int64) - start < limit)
    return going


@triton.jit
def wait_flag(
    ptr,
    target,
    timeout_ns,
    USE_CLOCK: tl.constexpr,
    SHIFT: tl.constexpr = 0,
    AT_LEAST: tl.constexpr = False,
):
    """Spin (acquire) until ``*ptr >> SHIFT`` equals ``target`` (or reaches it, ``AT_LEAST``).

    Returns ``(value, ok)``; ``ok`` is False when ``timeout_ns`` passed first. ``SHIFT=32``
    waits for the tag in the high half of a tagged int64 (``tag << 32 | payload``).
    """
    start = start_clock(USE_CLOCK)
    spins = tl.zeros((), tl.int32)
    value = load_acquire(ptr)
    if AT_LEAST:
        done = (value >> SHIFT) >= target
    else:
        done = (value >> SHIFT) == target
    while keep_waiting(done, start, timeout_ns, spins, USE_CLOCK):
        spins += 1
        value = load_acquire(ptr)
        if AT_LEAST:
            done = (value >> SHIFT) >= target
        else:
            done = (value >> SHIFT) == target
    return value, done


@triton.jit
def poll_acquire(ptrs, active, GPU_SCOPE: tl.constexpr):
    """One acquire read of every ``active`` flag, at system or (``GPU_SCOPE``) GPU scope."""
    if GPU_SCOPE:
        return tl.atomic_add(ptrs, 0, mask=active, sem="acquire", scope="gpu")
    return tl.atomic_add(ptrs, 0, mask=active, sem="acquire", scope="sys")


#: The most lanes a wait's flags may span and still be polled without a barrier: one warp's
#: threads. Triton lays out a tile this small inside one warp (the other warps hold copies),
#: so a check over all of it is a reduction within the warp; a larger tile's check goes
#: through shared memory and a barrier, and its wait then needs :func:`keep_waiting`.
WARP_LANES = tl.constexpr(32)


@triton.jit
def wait_all_at_least(
    ptrs, targets, active, timeout_ns, USE_CLOCK: tl.constexpr, GPU_SCOPE: tl.constexpr = False
):
    """Spin until ``ptrs[i] >= targets[i]`` for every ``active`` lane, then read them once
    more with acquire.

    One vector of flags polled together: int64 ring counters, one per peer, or
    (``GPU_SCOPE``) the int32 per-row flags that another launch on this GPU sets once it has
    written the rows (a relay between two legs, :mod:`tritonep.modes.internode`). Returns
    ``(values, ok)`` where ``ok`` says every active lane got there before ``timeout_ns``; both
    are the same on every thread of the program.

    While it waits, each thread reads the flags and its clock on its own, with plain volatile
    loads: an atomic's result would reach the other threads through shared memory and a
    barrier on every read, and a reduction across warps anywhere in the loop (to leave it at
    one clock reading) costs the normal combine about 10% at 2 ranks. Threads may leave the
    loop a read apart; it holds no barrier, so they meet at the first one after it, in the
    acquire read that decides ``values`` and ``ok`` for all of them alike. Flags spanning
    more than one warp (over WARP_LANES) are checked through shared memory on every read, so
    their loop agrees on one clock reading instead (:func:`keep_waiting`).
    """
    values = poll_acquire(ptrs, active, GPU_SCOPE)
    done = tl.min(tl.where(active & (values < targets), 0, 1), 0) > 0
    if not done:
        start = start_clock(USE_CLOCK)
        spins = tl.zeros((), tl.int32)
        if ptrs.numel <= WARP_LANES:
            waiting = not done  # true here: the loop reads at least once
            while waiting:
                spins += 1
                now = tl.load(ptrs, mask=active, other=0, volatile=True)
                seen = tl.min(tl.where(active & (now < targets), 0, 1), 0) > 0
                waiting = (not seen) & (elapsed_ns(start, spins, USE_CLOCK) < timeout_ns)
            values = poll_acquire(ptrs, active, GPU_SCOPE)
            done = tl.min(tl.where(active & (values < targets), 0, 1), 0) > 0
        else:
            while keep_waiting(done, start, timeout_ns, spins, USE_CLOCK):
                spins += 1
                values = poll_acquire(ptrs, active, GPU_SCOPE)
                done = tl.min(tl.where(active & (values < targets), 0, 1), 0) > 0
    tl.debug_barrier()
    return values, done


@triton.jit
def any_set(flags):
    """Whether any lane of a 2-D boolean tile is set."""
    return tl.max(tl.max(flags.to(tl.int32), axis=1), axis=0) > 0


@triton.jit
def wait_tile(
    ptrs,
    active,
    target,
    budget,
    timeout_us,
    status_ptr,
    USE_CLOCK: tl.constexpr,
    SHIFT: tl.constexpr = 0,
    AT_LEAST: tl.constexpr = False,
    TIMED: tl.constexpr = False,
):
    """Spin (acquire) until every ``active`` lane of a 2-D tile of int64 flags has
    ``flag >> SHIFT`` equal to ``target`` (or reaching it, ``AT_LEAST``).

    One read of the whole tile, usually enough; the status is read (:func:`limit_ns`) only
    when a lane is missing, and the wait then lasts at most ``min(budget, limit)``. Returns
    ``(values, missing, waited, limit)``: each lane's value from the read that found it
    arrived, the lanes still missing at the limit, with ``TIMED`` the nanoseconds until each
    lane was found, the read that found it included (reads under the interpreter; else 0),
    and the limit the wait had (for :func:`record_timeout`; ``budget`` when none was due).
    """
    start = tl.zeros((), tl.int64)
    if TIMED:
        start = start_clock(USE_CLOCK)
    values = poll_acquire(ptrs, active, False)
    if AT_LEAST:
        missing = active & ((values >> SHIFT) < target)
    else:
        missing = active & ((values >> SHIFT) != target)
    spins = tl.full((), 1, tl.int64)  # the first read counts as one
    waited = tl.zeros(values.shape, tl.int64)
    if TIMED:
        waited = tl.where(active, elapsed_ns(start, spins, USE_CLOCK), 0)
    limit = budget
    if any_set(missing):
        limit = tl.minimum(budget, limit_ns(timeout_us, status_ptr))
        if not TIMED:
            start = start_clock(USE_CLOCK)
        while keep_waiting(not any_set(missing), start, limit, spins, USE_CLOCK):
            spins += 1
            again = poll_acquire(ptrs, missing, False)
            if AT_LEAST:
                came = missing & ((again >> SHIFT) >= target)
            else:
                came = missing & ((again >> SHIFT) == target)
            values = tl.where(came, again, values)
            if TIMED:
                waited = tl.where(came, elapsed_ns(start, spins, USE_CLOCK), waited)
            missing = missing & ~came
        if TIMED:
            waited = tl.where(missing, elapsed_ns(start, spins, USE_CLOCK), waited)
    tl.debug_barrier()  # the acquire orders every thread's later reads
    return values, missing, waited, limit


@triton.jit
def relay_flag(relay_call_ptr):
    """The flag value of this call's rows: the reading launch's call counter + 1. Read once
    by the writing program; the reading launch cannot end (and count on) before every row it
    waits for is flagged, so the counter cannot move under the writer."""
    return (tl.load(relay_call_ptr, volatile=True) + 1).to(tl.int32)


@triton.jit
def publish_rows(flags, value, active):
    """Set the per-row flags of rows this program has written (after all its stores)."""
    tl.debug_barrier()
    tl.atomic_xchg(flags, value, mask=active, sem="release", scope="gpu")


@triton.jit
def first_lane(cond, lanes):
    """The lowest lane index where ``cond`` holds (``-1`` where it holds nowhere)."""
    lane = tl.min(tl.where(cond, lanes, 1 << 30), 0)
    return tl.where(lane == 1 << 30, -1, lane)


@triton.jit
def lane(values, lanes, index):
    """Element ``index`` along the last axis of a small tensor: of a ``[lanes]`` vector, a
    scalar; of a ``[rows, lanes]`` matrix, its ``[rows]`` column. A masked sum: Triton has no
    dynamic indexing."""
    return tl.sum(tl.where(lanes == index, values, 0), -1)


@triton.jit
def rows_before(hit, ROWS: tl.constexpr):
    """Exclusive prefix sum down the rows of a small ``[ROWS, lanes]`` int32 tensor.

    A masked sum over a ``[ROWS, ROWS, lanes]`` broadcast: Triton 3.6's scan lowering fails
    for some layouts of small 2-D tensors, and ``ROWS`` is at most a few dozen here.
    """
    rows = tl.arange(0, ROWS)
    earlier = (rows[None, :] < rows[:, None]).to(tl.int32)  # [row, earlier row]
    return tl.sum(earlier[:, :, None] * hit[None, :, :], 1)


def use_clock(device: torch.device) -> bool:
    """Whether kernels on ``device`` can read the GPU clock (not under the interpreter)."""
    return device.type == "cuda"


#: Longest limit a wait takes: the most microseconds an int32 holds (about 35 minutes).
MAX_TIMEOUT_S = (2**31 - 1) / 1e6


def timeout_us(timeout_s: float) -> int:
    """The kernels' argument for a limit of ``timeout_s`` seconds: whole microseconds (at
    least 1), an int32 for every limit; raises ValueError outside ``(0, MAX_TIMEOUT_S]``."""
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(
            f"timeout_s: expected a number of seconds in (0, {MAX_TIMEOUT_S:.0f}], got {timeout_s}"
        )
    return max(1, round(timeout_s * 1e6))


@triton.jit
def call_number(state_ptr, calls):
    """This program's call counter of row ``calls``: the launches of that phase before this one."""
    return tl.load(state_ptr + calls * tl.num_programs(0) + tl.program_id(0), volatile=True)


@triton.jit
def finish_launch(
    state_ptr,
    arrivals,
    send_calls,
    recv_calls,
    c_send,
    c_recv,
    DO_SEND: tl.constexpr,
    DO_RECV: tl.constexpr,
    ARRIVE: tl.constexpr,
):
    """Advance this program's call counters of the phases it ran.

    With ``ARRIVE``, also counts the programs that got here and returns whether this one is
    the last (every other program's work is done); without, returns False."""
    num_programs = tl.num_programs(0)
    column = tl.program_id(0)
    tl.debug_barrier()  # every thread of the program has read its counter long before
    if DO_SEND:
        tl.store(state_ptr + send_calls * num_programs + column, c_send + 1)
    if DO_RECV:
        tl.store(state_ptr + recv_calls * num_programs + column, c_recv + 1)
    last = False
    if ARRIVE:
        arrived = tl.atomic_add(state_ptr + arrivals * num_programs, 1, sem="acq_rel", scope="gpu")
        last = arrived == num_programs - 1
        if last:
            tl.store(state_ptr + arrivals * num_programs, 0)
    return last
