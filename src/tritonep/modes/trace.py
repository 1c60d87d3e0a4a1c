"""Kernel traces as Chrome trace JSON (open in Perfetto or chrome://tracing).

A mode built with ``profile=True`` hands every launch a readings buffer of its own
(:func:`TraceRecorder.buffer`) that the kernel fills (:mod:`tritonep.kernels.trace`). Nothing
is read back until :meth:`TraceRecorder.dump`, so profiling adds no host synchronization to the
calls themselves.

In the trace, a process is a rank and a thread is a program (one SM, named in its ``sm``
argument on GPUs) of a kernel. Each launch
shows, per program, its send and receive phases as slices, and inside them the program's
sub-phases (for example quantize and send, count send, wait, pack) laid end to end with their
summed durations, since a program interleaves them over its work items. On GPUs times are
in microseconds of the GPU's global timer; on CPU ranks (the Triton interpreter has no clock)
they are logical ticks that show the order only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels import trace as kt

#: The clock of CPU ranks' traces (the trace's ``otherData.clock`` and process names).
TICKS = "CPU rank, Triton interpreter: logical ticks, which order events but are not time"

SLOTS, START, SEND_END, END, FIRST_PHASE, SM = (
    int(v.value) for v in (kt.SLOTS, kt.START, kt.SEND_END, kt.END, kt.FIRST_PHASE, kt.SM)
)

#: Each traced kernel's two phases, as (name, sub-phase names): the send phase, the receive
#: phase. Normal-mode programs either send or receive, so each shows one of the two, split
#: into the time it waited (for ring space, rows or tails) and the rest. Elastic pushes: every
#: program's push, then its exchange (the arrive; in the last program also the headers or
#: tag, the wait for the peers' and, after the sub-phases, the decoding of the counts); their
#: epilogues: the wait for the push's grid, then the work.
# fmt: off
PHASES = {
    "elastic dispatch": (("push", ("scan", "stores")),
                         ("exchange", ("arrive", "headers", "wait"))),
    "elastic dispatch epilogue": (("wait", ()), ("copy", ("layout", "rows", "marks", "padding"))),
    "elastic combine": (("push", ("rows",)), ("exchange", ("arrive", "tag", "wait"))),
    "elastic combine sums": (("wait", ()), ("sums", ())),
    "elastic combine epilogue": (("wait", ()), ("reduce", ())),
    "low-latency dispatch": (("send", ("quantize and send", "count send")),
                             ("receive", ("wait", "pack"))),
    "low-latency combine": (("send", ("send", "signal")), ("receive", ("wait", "reduce"))),
    "normal notify": (("notify", ()), ("receive", ())),
    "normal dispatch": (("send", ("wait", "copy")), ("receive", ("wait", "copy"))),
    "normal combine": (("send", ("wait", "copy")), ("receive", ("wait", "reduce"))),
}
# fmt: on


#: int64 words of a readings arena on GPUs (16 MiB: some hundred launches of every SM).
ARENA_WORDS = 1 << 21


def phases(kernel: str):
    """The phases of ``kernel``; normal-mode kernels of any label (``"rail dispatch"``, the
    internode legs) have those of ``"normal dispatch"``."""
    return PHASES.get(kernel) or PHASES["normal " + kernel.split()[-1]]


@dataclass
class _Launch:
    kernel: str
    call: int
    readings: torch.Tensor  # [P * SLOTS + 1] int64
    phases: tuple[bool, bool]  # (ran the send phase, ran the receive phase)


class TraceRecorder:
    """The readings of every traced launch of one mode on one rank.

    Args:
        rank: this rank (the trace's process id).
        device: where the readings buffers live.
        scale_us: microseconds per reading unit (1e-3 for GPU nanoseconds).
    """

    def __init__(self, rank: int, device: torch.device, scale_us: float):
        self.rank, self.device, self.scale_us = rank, device, scale_us
        self.launches: list[_Launch] = []
        self.calls: dict[str, int] = {}
        self._arena: torch.Tensor | None = None
        self._arena_used = 0

    @staticmethod
    def of(profile, rank: int, device: torch.device, on_gpu: bool) -> TraceRecorder | None:
        """The recorder a mode uses for ``profile``: the one given, a new one, or None."""
        if isinstance(profile, TraceRecorder):
            return profile
        return TraceRecorder(rank, device, 1e-3 if on_gpu else 1.0) if profile else None

    def buffer(self, kernel: str, num_programs: int, send: bool, receive: bool) -> torch.Tensor:
        """A zeroed readings buffer for a launch of ``kernel`` that runs the send and/or the
        receive phase, kept for the dump."""
        if send or kernel not in self.calls:
            self.calls[kernel] = self.calls.get(kernel, -1) + 1
        readings = self._zeroed(num_programs * SLOTS + 1)
        if self.launches and self.device.type != "cuda":
            # The logical clock of the interpreter runs on from launch to launch.
            readings[-1:].copy_(self.launches[-1].readings[-1:])
        self.launches.append(_Launch(kernel, self.calls[kernel], readings, (send, receive)))
        return readings

    def _zeroed(self, words: int) -> torch.Tensor:
        """``words`` zeroed int64 words. On GPUs a slice of an arena zeroed when made: a zeroing
        kernel between two launches would stand between a push and its programmatic dependent
        epilogue and show a gap that untraced calls do not have."""
        if self.device.type != "cuda":
            return torch.zeros(words, dtype=torch.int64, device=self.device)
        if self._arena is None or self._arena_used + words > self._arena.numel():
            size = max(words, ARENA_WORDS)
            self._arena = torch.zeros(size, dtype=torch.int64, device=self.device)
            self._arena_used = 0
        readings = self._arena[self._arena_used : self._arena_used + words]
        self._arena_used += -(-words // 16) * 16  # 128-byte aligned slices
        return readings

    def _tables(self, kernels):
        launches = [lc for lc in self.launches if kernels is None or lc.kernel in kernels]
        return launches, [lc.readings[:-1].view(-1, SLOTS).cpu() for lc in launches]

    def origin(self, kernels: tuple[str, ...] | None = None) -> int | None:
        """The earliest reading of the launches of ``kernels``, or None."""
        _, tables = self._tables(kernels)
        starts = [
            int(t[:, START][t[:, END] > 0].min()) for t in tables if bool((t[:, END] > 0).any())
        ]
        return min(starts) if starts else None

    def events(self, kernels: tuple[str, ...] | None = None, origin: int | None = None):
        """Chrome trace events of the launches of ``kernels`` (all when None), with times
        counted from ``origin`` (default: this recorder's earliest reading)."""
        launches, tables = self._tables(kernels)
        origin = self.origin(kernels) if origin is None else origin
        if origin is None:
            return []
        name = f"rank {self.rank}" + ("" if self.device.type == "cuda" else f" ({TICKS})")
        events = [{"ph": "M", "name": "process_name", "pid": self.rank, "args": {"name": name}}]
        for launch, table in zip(launches, tables, strict=True):
            (send_name, send_subs), (recv_name, recv_subs) = phases(launch.kernel)
            for program, row in enumerate(table.tolist()):
                start, send_end, end = row[START], row[SEND_END], row[END]
                if end == 0:
                    continue  # the program did not run (or the launch never finished)
                totals = row[FIRST_PHASE:SM]
                spans = [
                    (send_name, start, send_end, send_subs, totals[: len(send_subs)]),
                    (
                        recv_name,
                        send_end,
                        end,
                        recv_subs,
                        totals[len(send_subs) : len(send_subs) + len(recv_subs)],
                    ),
                ]
                for ran, (name, begin, finish, subnames, subtotals) in zip(
                    launch.phases, spans, strict=True
                ):
                    if not ran or (finish <= begin and not any(subtotals)):
                        continue
                    args = {
                        "kernel": launch.kernel,
                        "call": launch.call,
                        "program": program,
                        "phase": name,
                    }
                    if row[SM] >= 0:  # GPUs: the SM the program ran on
                        args["sm"] = row[SM]
                    events.append(
                        self._slice(
                            f"{launch.kernel}: {name}", begin, finish - begin, origin, program, args
                        )
                    )
                    at = begin
                    for subname, total in zip(subnames, subtotals, strict=True):
                        if total > 0:
                            events.append(self._slice(subname, at, total, origin, program, args))
                            at += total
        return events

    def _slice(self, name, begin, duration, origin, program, args) -> dict:
        return {
            "name": name,
            "ph": "X",
            "pid": self.rank,
            "tid": program,
            "ts": (begin - origin) * self.scale_us,
            "dur": duration * self.scale_us,
            "args": args,
        }

    def dump(self, path: str | Path, kernels: tuple[str, ...] | None = None) -> Path:
        """Write the Chrome trace JSON of this rank's launches (of ``kernels``) to ``path``."""
        return write_chrome_trace(path, [self], kernels)

    def clear(self) -> None:
        self.launches.clear()


def write_chrome_trace(
    path: str | Path, recorders: list[TraceRecorder], kernels: tuple[str, ...] | None = None
) -> Path:
    """Write the launches of several recorders (the modes of one rank) on one time axis."""
    origins = [o for r in recorders if (o := r.origin(kernels)) is not None]
    origin = min(origins) if origins else 0
    events = [e for r in recorders for e in r.events(kernels, origin)]
    on_gpu = all(r.device.type == "cuda" for r in recorders)
    clock = "microseconds of the GPU's global timer" if on_gpu else TICKS
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"clock": clock}}))
    return path


def _runs(recorder: TraceRecorder, kernel: str) -> dict[int, list[tuple[list[int], bool, bool]]]:
    """Per call of ``kernel``: the readings of each of its programs that ran, in each launch
    (one, or a send and a receive launch), with the phases that launch ran."""
    runs: dict[int, list[tuple[list[int], bool, bool]]] = {}
    for launch in recorder.launches:
        if launch.kernel == kernel:
            for row in launch.readings[:-1].view(-1, SLOTS).tolist():
                if row[END] > 0:
                    runs.setdefault(launch.call, []).append((row, *launch.phases))
    return runs


def _median(values) -> float:
    return float(torch.tensor(values, dtype=torch.float64).median()) if values else 0.0


def _program_phases(kernel: str, row: list[int], send: bool, receive: bool):
    """``(name, ticks)`` of one program's readings: each phase it ran (its span), its
    sub-phases and the rest of the phase (``"<phase>: other"``)."""
    (send_name, send_subs), (recv_name, recv_subs) = phases(kernel)
    totals = row[FIRST_PHASE:SM]
    split = len(send_subs)
    for ran, phase, begin, end, subs, subtotals in (
        (send, send_name, row[START], row[SEND_END], send_subs, totals[:split]),
        (receive, recv_name, row[SEND_END], row[END], recv_subs, totals[split:][: len(recv_subs)]),
    ):
        if not ran:
            continue
        yield phase, end - begin
        yield from zip(subs, subtotals, strict=True)
        if subs:
            yield f"{phase}: other", end - begin - sum(subtotals)


def phase_medians(recorder: TraceRecorder, kernel: str) -> dict[str, tuple[float, float, int]]:
    """Each phase of ``kernel`` (its span), each sub-phase and the rest of each phase
    (``"<phase>: other"``, the span less its sub-phases): ``(median, mean, programs)`` in
    microseconds over the programs of every call that spent time in it, and how many
    programs of all calls did (the mean, as a coarse timer rounds each reading)."""
    values: dict[str, list[float]] = {}
    for rows in _runs(recorder, kernel).values():
        for row, send, receive in rows:
            for name, ticks in _program_phases(kernel, row, send, receive):
                if ticks > 0:
                    values.setdefault(name, []).append(ticks * recorder.scale_us)
    return {name: (_median(v), sum(v) / len(v), len(v)) for name, v in values.items()}


def critical_path(recorder: TraceRecorder, kernels: tuple[str, ...]) -> dict[str, dict]:
    """The launches of ``kernels`` that make one call (e.g. a push and its epilogue), per
    kernel: ``"start"`` (its first program's), ``"<send phase> end"`` (the last program to
    end its first phase), ``"end"`` (the last program's), each call's times counted from
    the call's first start; and ``"last"``, the phases of the program that ended last (in an
    elastic push, the one that exchanged the headers). Medians over the calls, in
    microseconds."""
    runs = [_runs(recorder, k) for k in kernels]
    calls = sorted(set.intersection(*(set(r) for r in runs))) if runs else []
    points: dict[str, dict[str, list[float]]] = {k: {} for k in kernels}
    for call in calls:
        origin = min(row[START] for r in runs for row, _, _ in r[call])
        for kernel, r in zip(kernels, runs, strict=True):
            (send, _), _ = phases(kernel)
            rows = r[call]
            sent = [row[SEND_END] for row, ran, _ in rows if ran] or [origin]
            last = max(rows, key=lambda run: run[0][END])
            mine = points[kernel]
            for name, value in (
                ("start", min(row[START] for row, _, _ in rows)),
                (f"{send} end", max(sent)),
                ("end", last[0][END]),
            ):
                mine.setdefault(name, []).append((value - origin) * recorder.scale_us)
            for name, ticks in _program_phases(kernel, *last):
                mine.setdefault("last: " + name, []).append(ticks * recorder.scale_us)
    path: dict[str, dict] = {}
    for kernel, mine in points.items():
        path[kernel] = {n: _median(v) for n, v in mine.items() if not n.startswith("last: ")}
        path[kernel]["last"] = {
            n[len("last: ") :]: _median(v) for n, v in mine.items() if n.startswith("last: ")
        }
    return path
