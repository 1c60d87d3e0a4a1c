"""What went wrong in a mode's launches: recorded on the device, read on the host without a sync.

Each mode keeps one *status*: ``int32 [STATUS_WORDS]`` words on its device that every kernel
receives. The first failure of a launch wins a compare-and-swap on word 0 and writes the
record::

    0 code     STATUS_OK, STATUS_TIMEOUT, STATUS_OVERFLOW or STATUS_BAD_ID
    1 peer     the rank waited for (timeouts), or the rank whose ids were bad
    2 phase    what the kernel was doing (each mode names its phases)
    3 detail   timeouts: an expert or channel (-1: none); bad ids: the token
    4 limit    timeouts: the limit the failed wait had, in microseconds
    5 column   bad ids: the top-k column
    6, 7       bad ids: the id (int64, low word first)
    14, 15     the address of the host copy (int64; 0: none)

A timeout takes the place of an overflow or of bad ids nobody has read yet: later launches
read word 0 to stop waiting (:func:`tritonep.kernels.sync.limit_ns`), so a timeout must show
there. Bad ids record only into an empty status.

The host copy. :class:`Status` also allocates the first :data:`RECORD_WORDS` words in
page-locked host memory, which the GPU writes directly (under unified addressing its device
address is its host address), and puts its address in words 14 and 15. The winner of a record
writes words 1 to 7 there, then a system-scope fence, then the code, so the host never sees a
code without its record. Reading it is a load from host memory: no CUDA call, no
synchronization, a fraction of a microsecond; a record appears there as soon as the kernel
wrote it, whether or not the launch has ended. On CPU ranks both are plain CPU tensors.

How the modes use it: each call first reads the host copy, makes its launches as usual (its
peers then get what they wait for) and then raises the recorded error if there was one
(:meth:`Status.raise_recorded`); ``check()`` waits for the device and reads the device words.
A timeout stays (the mode's call counters no longer agree with its peers'); bad ids and an
overflow are raised once and cleared, since the ranks stayed in step.
"""

from __future__ import annotations

import ctypes

import torch
import triton
import triton.language as tl
from triton import knobs

from ..errors import WaitTimeoutError

#: int32 words of a status tensor.
STATUS_WORDS = 16
#: Words of a record (code to the id's high word), the ones copied to the host.
RECORD_WORDS = 8
#: Index of the int64 host-copy address, in int64 words.
MIRROR_INDEX = tl.constexpr(7)

STATUS_OK = tl.constexpr(0)
STATUS_TIMEOUT = tl.constexpr(1)
#: More rows arrived than the outputs hold (worst-case sizing); the excess was not written.
STATUS_OVERFLOW = tl.constexpr(2)
#: A top-k id outside ``[-1, num_experts)``: the kernels skipped that choice.
STATUS_BAD_ID = tl.constexpr(3)

# The interpreter runs programs one after another and has no inline assembly: no fence there.
_FENCE = tl.constexpr(not knobs.runtime.interpret)


@triton.jit
def fence_system():
    """Order this thread's earlier stores before its later ones for every observer."""
    if _FENCE:
        tl.inline_asm_elementwise(
            "fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def write_record(status_ptr, code, peer, phase, detail, limit_us, column, bad_id):
    """Write a record this program has won (word 0 already holds ``code``) to the device words
    and, where there is one, to the host copy (code last, after a fence)."""
    tl.store(status_ptr + 1, peer)
    tl.store(status_ptr + 2, phase)
    tl.store(status_ptr + 3, detail)
    tl.store(status_ptr + 4, limit_us)
    tl.store(status_ptr + 5, column)
    tl.store((status_ptr + 6).to(tl.pointer_type(tl.int64)), bad_id)
    host = tl.load(status_ptr.to(tl.pointer_type(tl.int64)) + MIRROR_INDEX)
    if host != 0:
        words = host.to(tl.pointer_type(tl.int32))
        tl.store(words + 1, peer)
        tl.store(words + 2, phase)
        tl.store(words + 3, detail)
        tl.store(words + 4, limit_us)
        tl.store(words + 5, column)
        tl.store((words + 6).to(tl.pointer_type(tl.int64)), bad_id)
        fence_system()
        tl.store(words, code)


@triton.jit
def record_timeout(
    status_ptr, peer, phase, timeout_ns, detail=-1, code: tl.constexpr = STATUS_TIMEOUT
):
    """Record the first failure: a wait for ``peer`` gave up after ``timeout_ns`` (the limit it
    had, from :func:`~tritonep.kernels.sync.limit_ns`), or (``code=STATUS_OVERFLOW``) rows
    overflowed. A timeout also replaces an overflow or bad ids nobody has read yet: they
    would hide it, and later launches would wait again."""
    won = tl.atomic_cas(status_ptr, STATUS_OK, code, sem="relaxed") == STATUS_OK
    if code == STATUS_TIMEOUT:  # noqa: SIM102 (compiled in or out; the inner test runs)
        if not won:
            was = tl.atomic_cas(status_ptr, STATUS_OVERFLOW, code, sem="relaxed")
            won = was == STATUS_OVERFLOW
            if not won:
                was = tl.atomic_cas(status_ptr, STATUS_BAD_ID, code, sem="relaxed")
                won = was == STATUS_BAD_ID
    if won:  # (the stores narrow the limit to int32)
        write_record(status_ptr, code, peer, phase, detail, timeout_ns // 1000, -1, -1)


@triton.jit
def record_bad_id(status_ptr, rank, phase, token, column, bad_id):
    """Record that ``rank`` passed ``bad_id`` (outside ``[-1, num_experts)``) as top-k column
    ``column`` of ``token``, unless the status already holds a record."""
    won = tl.atomic_cas(status_ptr, STATUS_OK, STATUS_BAD_ID, sem="relaxed") == STATUS_OK
    if won:
        write_record(status_ptr, STATUS_BAD_ID, rank, phase, token, 0, column, bad_id.to(tl.int64))


@triton.jit
def first_bad_id(
    topk_idx_ptr,  # [num_tokens, K] int64 top-k ids
    num_tokens,  # rows of topk_idx_ptr
    K,  # ids per token (a constexpr or a run-time value)
    NUM_EXPERTS: tl.constexpr,  # valid ids are -1 (none) and 0 to NUM_EXPERTS - 1
    BLOCK_K: tl.constexpr,  # power of two >= K
    BLOCK_TOKENS: tl.constexpr,  # tokens scanned per step
):
    """The first (token, column, id) of ``[num_tokens, K]`` int64 ids whose id lies outside
    ``[-1, NUM_EXPERTS)``, in token order; ``(-1, -1, 0)`` if none (``K``, at most ``BLOCK_K``,
    a constexpr or a run-time value). A slow scan: it runs only once a kernel has seen such
    an id."""
    ks = tl.arange(0, BLOCK_K)
    found = tl.full((), 2**31 - 1, tl.int32)
    for start in range(0, num_tokens, BLOCK_TOKENS):
        tokens = start + tl.arange(0, BLOCK_TOKENS)
        valid = (tokens[:, None] < num_tokens) & (ks[None, :] < K)
        ids = tl.load(
            topk_idx_ptr + tokens[:, None].to(tl.int64) * K + ks[None, :], mask=valid, other=-1
        )
        bad = valid & ((ids < -1) | (ids >= NUM_EXPERTS))
        at = tl.where(bad, tokens[:, None] * K + ks[None, :], 2**31 - 1)
        found = tl.minimum(found, tl.min(tl.min(at, axis=1), axis=0))
    token = tl.where(found < 2**31 - 1, found // K, -1)
    column = tl.where(found < 2**31 - 1, found % K, -1)
    bad_id = tl.load(topk_idx_ptr + tl.maximum(found, 0).to(tl.int64), mask=token >= 0, other=0)
    return token, column, bad_id


def host_words(count: int, device: torch.device) -> tuple[torch.Tensor, ctypes.Array]:
    """``count`` zeroed int32 words in host memory that kernels on ``device`` write (page-locked
    on GPUs, whatever torch's default device is), and a ctypes view that reads them without a
    torch call; the tensor keeps the memory alive."""
    words = torch.zeros(count, dtype=torch.int32, device="cpu", pin_memory=device.type == "cuda")
    return words, (ctypes.c_int32 * count).from_address(words.data_ptr())


def new_status(device: torch.device) -> torch.Tensor:
    """A zeroed ``int32 [STATUS_WORDS]`` status without a host copy (see :class:`Status`)."""
    return torch.zeros(STATUS_WORDS, dtype=torch.int32, device=device)


class Status:
    """A mode's status: the device words its kernels receive, and their host copy.

    Args:
        device: where the mode's kernels run (a CUDA device, or the CPU for CPU ranks).
    """

    def __init__(self, device: torch.device):
        #: ``int32 [STATUS_WORDS]`` on ``device``: the kernels' argument.
        self.words = new_status(device)
        #: ``int32 [RECORD_WORDS]`` in host memory the device writes (page-locked on GPUs).
        self.host, self._view = host_words(RECORD_WORDS, device)
        address = torch.tensor([self.host.data_ptr()], dtype=torch.int64, device="cpu")
        address = address.view(torch.int32)
        self.words[2 * MIRROR_INDEX.value :].copy_(address)

    def recorded(self) -> int:
        """The code of the host copy (``STATUS_OK`` = 0 while nothing was recorded); reads
        host memory only."""
        return self._view[0]

    def record(self) -> list[int]:
        """The host copy's :data:`RECORD_WORDS` words (no synchronization)."""
        return list(self._view)

    def synced_record(self) -> list[int]:
        """The device words, once every launch so far has ended (synchronizes)."""
        return self.words.tolist()[:RECORD_WORDS]

    def clear(self) -> None:
        """Forget a record that was raised and does not stay (bad ids, an overflow): the host
        copy now, the device words in stream order, where a timeout recorded since stays."""
        code = self.words[:1]
        code.masked_fill_((code == STATUS_BAD_ID.value) | (code == STATUS_OVERFLOW.value), 0)
        if self._view[0] != STATUS_TIMEOUT.value:
            ctypes.memset(ctypes.addressof(self._view), 0, 4 * RECORD_WORDS)

    def raise_recorded(self, words: list[int], raise_error) -> None:
        """Raise what ``words`` (a record) holds through ``raise_error(words)``; a record that
        does not stay is cleared first."""
        if words[0] == STATUS_OK.value:
            return
        if words[0] != STATUS_TIMEOUT.value:
            self.clear()
        raise_error(words)


def wait_host_word(view, device: torch.device, stuck) -> None:
    """Spin until ``view[0]`` (a ctypes word in host memory that a launch on the current
    stream writes) is set, as DeepEP polls its mapped counters: the words are read as soon as
    the kernel writes them, with no copy and no synchronization. The kernel's own waits are
    bounded; now and then the poll asks whether the stream has run dry without the word (a
    failed launch, which would leave it unset), and then calls ``stuck()``, which raises."""
    polls = 0
    while not view[0]:
        polls += 1
        if polls % 4096 == 0 and stream_idle(device) and not view[0]:
            stuck()


def stream_idle(device: torch.device) -> bool:
    """Whether every launch so far on ``device``'s current stream has ended (the
    interpreter's have, when they return)."""
    return device.type != "cuda" or torch.cuda.current_stream(device).query()


def raise_on_timeout(
    status: torch.Tensor, rank: int, phases: dict[int, str], detail: str = ""
) -> None:
    """Raise :class:`WaitTimeoutError` if a launch recorded a timeout (reads ``status``: syncs).

    ``detail`` is formatted with the recorded detail value (e.g. ``"expert {}"``).
    """
    check_status(status.tolist(), rank, phases, detail)


def check_status(words: list[int], rank: int, phases: dict[int, str], detail: str = "") -> None:
    """:func:`raise_on_timeout` for a status already read to the host (its first
    :data:`RECORD_WORDS` ints, or more).

    Raises :class:`WaitTimeoutError` for a timeout, ``ValueError`` for an overflow of
    worst-case outputs or for bad ids (see :func:`bad_id_error`).
    """
    code, peer, phase, value, limit_us = words[:5]
    if code == STATUS_OVERFLOW.value:
        raise ValueError(
            f"num_worst_tokens: rank {rank} received {value} rows, more than the outputs hold; "
            "the rows past the end were dropped (raise num_worst_tokens)"
        )
    if code == STATUS_TIMEOUT.value:
        name = phases.get(phase, f"phase {phase}")
        if detail and value >= 0:
            name = f"{name}, {detail.format(value)}"
        raise WaitTimeoutError(rank, peer, name, limit_us / 1e6)
    if code == STATUS_BAD_ID.value:
        raise bad_id_error(words, phases.get(phase, f"phase {phase}"))


def bad_id_error(words: list[int], call: str, num_experts: int | None = None) -> ValueError:
    """The ``ValueError`` for a bad-id record: it names the argument, the rank, the token, the
    column and the id."""
    _, rank, _, token, _, column, low, high = words[:RECORD_WORDS]
    bad_id = (high << 32) | (low & 0xFFFFFFFF)
    allowed = f"[-1, {num_experts})" if num_experts is not None else "[-1, num_experts)"
    return ValueError(
        f"topk_idx: token {token}, column {column} of rank {rank}'s {call} names expert "
        f"{bad_id}, outside {allowed} (-1 = no expert); the kernels dropped that choice. "
        "Raised by the next call of this buffer (ids are checked on the device; "
        "check_ids=True checks them on the host before launching, at the cost of a host "
        "synchronization)"
    )
