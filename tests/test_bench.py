"""The benchmark tool end to end on CPU ranks: sweep, table, CSV, markdown, plot, comparison.

Times measured here mean nothing (the kernels run under the interpreter); the test checks that
every column is produced and consistent, not how fast anything is.
"""

import argparse
import json
import math
import sys

import pytest

from tritonep.bench import cli, report, traced
from tritonep.cli import main as tritonep_main


def _run(tmp_path, mode, *extra):
    out = tmp_path / f"{mode}.csv"
    code = cli.main([mode, "--ranks", "2", "--iters", "1", "--quiet", "--csv", str(out), *extra])
    assert code == 0
    return report.read_csv(out)


def test_normal_sweep_with_comparison(tmp_path, capfd):
    rows = _run(
        tmp_path,
        "normal",
        "--tokens",
        "4,12",
        "--hidden",
        "256",
        "--compare",
        "tritonep.deep_ep",
        "--copy-chunks",
        "1,3",
        "--copy-share",
        "6",
    )
    assert [r["tokens"] for r in rows] == [4, 12, 4, 12]
    assert [r["copy_chunks"] for r in rows] == [1, 1, 3, 3]
    assert [r["copy_share"] for r in rows] == [6] * 4
    on_cpu = rows[0]["device"] == report.INTERPRETER
    assert {r["device"] for r in rows} == {report.INTERPRETER if on_cpu else "cuda"}
    for row in rows:
        assert row["mode"] == "normal" and row["ranks"] == 2 and row["hidden"] == 256
        for key in (
            "dispatch_us",
            "fp8_dispatch_us",
            "combine_us",
            "torch_dispatch_us",
            "torch_combine_us",
            "deep_ep_dispatch_us",
            "deep_ep_combine_us",
            "copy_combine_us",
        ):
            assert row[key] > 0, key
        kernels = ("kernel_dispatch_us", "kernel_fp8_dispatch_us", "kernel_combine_us")
        if on_cpu:  # no CUDA graphs on CPU ranks, nor a profiler of kernels
            assert math.isnan(row["graph_dispatch_us"]) and math.isnan(row["graph_copy_combine_us"])
            assert all(math.isnan(row[k]) for k in kernels)
        else:  # the kernels alone take less than the calls around them
            assert all(row[k] > 0 for k in kernels)
            assert row["kernel_dispatch_GBps"] >= 0.9 * row["dispatch_GBps"]
        # DeepEP's accounting counts the local rank too, so it bounds the remote figure.
        assert row["dispatch_GBps"] >= row["dispatch_remote_GBps"] >= 0
    table = capfd.readouterr().out  # the terminal table, marked when interpreted
    assert "torch_combine_us" in table and ("Triton interpreter" in table) == on_cpu

    md = tmp_path / "BENCH.md"
    md.write_text("# Results\n\nkept\n")
    assert (
        cli.main(
            ["report", str(tmp_path / "normal.csv"), "--markdown", str(md), "--section", "cpu"]
        )
        == 0
    )
    assert (
        cli.main(
            ["report", str(tmp_path / "normal.csv"), "--markdown", str(md), "--section", "cpu"]
        )
        == 0
    )
    text = md.read_text()
    assert text.startswith("# Results\n\nkept\n")
    assert text.count("<!-- bench:cpu -->") == 1  # a second report replaces the first
    assert "| 2 | 12 | 256 |" in text
    assert (report.INTERPRETER_NOTE in text) == on_cpu


def test_low_latency_sweep_over_topk_and_an_absent_rival(tmp_path, capfd):
    trace = str(tmp_path / "trace-{rank}.json")
    # One rank per emulated node: every peer is on another node, reached through staging.
    rows = _run(
        tmp_path,
        "low-latency",
        "--tokens",
        "3",
        "--topk",
        "1,2",
        "--bf16",
        "--compare",
        "no_such_module",
        "--trace",
        trace,
        "--gpus-per-node",
        "1",
        "--logfmt",
    )
    for rank in range(2):
        text = (tmp_path / f"trace-{rank}.json").read_text()
        assert "low-latency dispatch: send" in text and "pack" in text
    assert [(r["tokens"], r["topk"]) for r in rows] == [(3, 1), (3, 2)]
    assert all(r["gpus_per_node"] == 1 and r["transport"] == "copy" for r in rows)
    assert all(r["dispatch_dtype"] == "bf16" and r["combine_dtype"] == "logfmt" for r in rows)
    assert all(r["dispatch_us"] > 0 and r["torch_combine_us"] > 0 for r in rows)
    assert "deep_ep_dispatch_us" not in rows[0]
    assert "not importable" in capfd.readouterr().err  # a note, not a row of the table

    paths = [trace.format(rank=r) for r in range(2)]
    summary = {(r["kernel"], r["slice"]): r for r in traced.summarize(paths)}
    # Times of GPUs; the interpreter's logical ticks on CPU ranks, and named so.
    on_gpu = rows[0]["device"] == "cuda"
    unit = "us" if on_gpu else "ticks"
    clock = json.loads((tmp_path / "trace-0.json").read_text())["otherData"]["clock"]
    assert ("microseconds" in clock) == on_gpu and ("logical ticks" in clock) != on_gpu
    # 3 traced dispatch + combine pairs per rank; every phase of both kernels is there.
    # Sub-phases are named with their phase (normal senders and receivers both "wait").
    for key in [
        ("low-latency dispatch", "send: quantize and send"),
        ("low-latency dispatch", "receive: pack"),
        ("low-latency combine", "receive: reduce"),
    ]:
        assert summary[key]["launches"] == 6 and summary[key]["programs"] >= 1, summary[key]
        assert summary[key][f"launch_span_{unit}"] >= summary[key][f"max_{unit}"] > 0
    assert cli.main(["trace-summary", *paths]) == 0
    out = capfd.readouterr().out
    assert "quantize and send" in out and f"median_{unit}" in out


def test_internode_legs(tmp_path):
    out = tmp_path / "internode.csv"
    args = [
        "internode",
        "--ranks",
        "4",
        "--gpus-per-node",
        "2",
        "--tokens",
        "8",
        "--iters",
        "1",
        "--quiet",
        "--csv",
        str(out),
    ]
    assert cli.main(args) == 0
    (row,) = report.read_csv(out)
    assert row["gpus_per_node"] == 2 and row["tokens"] == 8
    for key in ("dispatch_us", "combine_us", "rail_leg_us", "node_leg_us", "torch_dispatch_us"):
        assert row[key] > 0, key
    # 8 tokens of 256 BF16 channels, top-4 of 16 experts: some rows cross each leg.
    assert row["network_MB"] > 0 and row["nvlink_MB"] > 0
    assert row["model_dispatch_us"] > 25  # the fixed cost plus the bytes


def test_overlap_rows_cover_every_path_operation_priority_and_order(tmp_path):
    """``bench overlap``: a row per path (``--tune`` adds one), operation, stream priority and
    start order (the slots' epilogue also deferred past the GEMM), whose derived columns
    follow from the measured ones (on CPU ranks the two sides run one after the other, so the
    one launched second ends after the other)."""
    rows = _run(
        tmp_path, "overlap", "--tokens", "8", "--tune", "epilogue_sms=1", "--carveout", "8",
        "--start", "queued", "--blas", "cublaslt", "--copy-chunks", "1,2",
    )  # fmt: skip
    combos = {(r["path"], r["op"], r["priority"], r["order"]) for r in rows}
    # 2 operations x 2 priorities x orders: the rings' 2, each slots path's 3; each copies
    # path's (one a chunk count) combine only, in 2 orders
    assert len(rows) == len(combos) == 4 * (2 + 3 + 3) + 2 * (2 * 2)
    assert {r["start"] for r in rows} == {"queued"}  # (the device-side wait: on GPUs only)
    paths = {"rings", "copies[1]", "copies[2]", "slots", "slots[epilogue_sms=1]"}
    assert {c[0] for c in combos} == paths
    assert {c[1] for c in combos if c[0].startswith("copies")} == {"combine"}
    deferred = {c[0] for c in combos if c[3] == "gemm-first-deferred"}
    assert deferred == {"slots", "slots[epilogue_sms=1]"}  # (the rings have no epilogue)
    assert {c[1] for c in combos} == {"dispatch", "combine"}
    for row in rows:
        assert row["mode"] == "overlap" and row["gemm"] == 64
        assert (row["sms"] == 0) == row["path"].startswith("copies")  # (no SM moves rows)
        assert row["carveout"] == 8 and row["blas"] == "cublaslt"
        for key in ("gemm_full_us", "gemm_alone_us", "comm_alone_us", "gemm_us", "comm_us"):
            assert row[key] > 0, key
        assert row["both_us"] == max(row["gemm_us"], row["comm_us"])
        assert row["serial_us"] == pytest.approx(row["gemm_alone_us"] + row["comm_alone_us"])
        assert row["gemm_slowdown"] == pytest.approx(row["gemm_us"] / row["gemm_alone_us"])
        assert row["finish_ratio"] == pytest.approx(row["both_us"] / row["gemm_alone_us"])
        assert row["full_finish_ratio"] == pytest.approx(row["both_us"] / row["gemm_full_us"])
        if row["device"] == report.INTERPRETER:
            first, second = (
                ("comm_us", "gemm_us") if row["order"] == "comm-first" else ("gemm_us", "comm_us")
            )
            assert row[second] > row[first]


def test_the_gemm_carveout_holds_within_and_is_restored():
    """``--carveout``: torch's SM carveout for matmuls is set within and put back after, also
    when the body raises; 0 leaves it alone."""
    import torch

    from tritonep.bench.overlap import gemm_carveout

    before = torch._C._get_sm_carveout_experimental()
    with gemm_carveout(0):
        assert torch._C._get_sm_carveout_experimental() == before
    with pytest.raises(KeyError), gemm_carveout(24):
        assert torch._C._get_sm_carveout_experimental() == 24
        raise KeyError
    assert torch._C._get_sm_carveout_experimental() == before


def test_the_blas_library_is_left_alone_on_cpu_ranks():
    """``--blas cublaslt`` on a CPU rank changes nothing (torch's CPU builds have no cuBLASLt)."""
    import torch

    from tritonep.bench.overlap import blas_library

    before = torch.backends.cuda.preferred_blas_library()
    with blas_library("cublaslt", torch.device("cpu")):
        assert torch.backends.cuda.preferred_blas_library() == before
    assert torch.backends.cuda.preferred_blas_library() == before


@pytest.mark.gpu
def test_the_blas_library_holds_within_and_is_restored():
    """``--blas cublaslt``: torch's matmuls go through cuBLASLt within, and the library of
    before comes back after, also when the body raises."""
    import torch

    from tritonep.bench.overlap import blas_library

    before = torch.backends.cuda.preferred_blas_library()
    with pytest.raises(KeyError), blas_library("cublaslt", torch.device("cuda")):
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
        raise KeyError
    assert torch.backends.cuda.preferred_blas_library() == before


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        {
            "mode": "normal",
            "ranks": 4,
            "hidden": 7168,
            "topk": 8,
            "experts": 256,
            "tokens": t,
            "dispatch_us": 100.0 * t,
            "combine_us": 90.0 * t,
            "torch_dispatch_us": 300.0 * t,
            "torch_combine_us": 250.0 * t,
            "dispatch_remote_GBps": 150.0,
            "dispatch_GBps": 200.0,
        }
        for t in (128, 1024, 4096)
    ]
    path = tmp_path / "plot.png"
    labels = report.plot(rows, path, ceiling_gbps=370)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert labels == [
        "tritonep dispatch",
        "tritonep combine",
        "torch dispatch",
        "torch combine",
        "dispatch (remote)",
        "dispatch (DeepEP accounting)",
        "NVLink ceiling (remote)",
    ]
    # Rows of CPU ranks: no GPU link to compare interpreted kernels with.
    cpu_rows = [dict(row, device=report.INTERPRETER) for row in rows]
    assert "NVLink ceiling (remote)" not in report.plot(cpu_rows, path, ceiling_gbps=370)
    # Graph timings get lines of their own; a column that CPU ranks leave NaN gets none.
    timed = [
        dict(row, graph_dispatch_us=80.0 * row["tokens"], graph_combine_us=math.nan) for row in rows
    ]
    labels = report.plot(timed, path)
    assert "tritonep dispatch, CUDA graph" in labels
    assert "tritonep combine, CUDA graph" not in labels
    # A sweep over top-k: a line per top-k, not one line zig-zagging between them.
    sweep = [dict(row, topk=k, tokens=row["tokens"] + k) for row in rows for k in (4, 8)]
    labels = report.plot(sweep, path)
    assert "tritonep dispatch (topk 4)" in labels and "tritonep dispatch (topk 8)" in labels
    assert len(labels) == 12


def test_console_script_names_its_commands(capfd):
    import tritonep

    assert tritonep_main([]) == 2
    err = capfd.readouterr().err
    assert all(name in err for name in ("bench", "soak", "demo"))
    assert tritonep_main(["--help"]) == 0 and "soak" in capfd.readouterr().out
    assert tritonep_main(["--version"]) == 0
    assert capfd.readouterr().out == f"tritonep {tritonep.__version__}\n"
    with pytest.raises(SystemExit) as info:  # each command parses its own options
        tritonep_main(["soak", "--help"])
    assert info.value.code == 0 and "--gpus-per-node" in capfd.readouterr().out


def test_launch_constants_label_the_rows_and_bad_ones_stop_the_run(tmp_path, monkeypatch):
    from tritonep.modes import normal

    # The rows in the CSV are those rank 0 appended as each point finished: the run's final
    # rewrite of the file is switched off here.
    monkeypatch.setattr(report, "write_csv", lambda rows, path: None)
    rows = _run(
        tmp_path,
        "normal",
        "--tokens",
        "9",
        "--launch",
        "COMBINE_SEND_TILE=64",
        "--launch",
        "STEP_ROWS=2",
    )
    (row,) = rows
    assert row["launch"] == "COMBINE_SEND_TILE=64 STEP_ROWS=2" and row["combine_us"] > 0
    assert (normal.COMBINE_SEND_TILE, normal.STEP_ROWS) == (16384, 32)  # this process: unchanged
    for bad, says in [
        ("SEND_TILE=3", "power of two"),
        ("NUM_SMS=4", "not a launch constant"),
        ("STEP_ROWS", "NAME=VALUE"),
        ("DISPATCH_WARPS=64", "4, 8, 16 or 32"),
    ]:
        with pytest.raises(SystemExit, match=says):
            cli.main(["normal", "--ranks", "2", "--launch", bad])


def test_every_option_says_what_it_does_and_its_default():
    parser = cli._parser()
    (modes,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in modes.choices.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if "--help" in action.option_strings:
                continue
            assert action.help, (name, action.dest)
            if action.option_strings and action.nargs != 0:  # options that take a value
                assert "default" in formatter._get_help_string(action), (name, action.dest)


def test_the_costmodel_explains_itself(capsys):
    from tritonep.costmodel import main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    text = capsys.readouterr().out
    assert info.value.code == 0 and len(text.splitlines()) < 50  # not the module's docstring
    words = " ".join(text.split())
    assert "(default: 1,2,4,8,16,32)" in words and "(default: 370.0)" in words


def test_token_sweeps_fit_where_the_ranks_run():
    args = cli._parser().parse_args(["normal", "--tokens", "sweep"])
    assert cli._options(args, on_gpu=True).tokens[-1] == 16384
    assert cli._options(args, on_gpu=False).tokens == [4, 8, 16, 32]  # minutes, not hours
    args = cli._parser().parse_args(["low-latency"])
    assert cli._options(args, on_gpu=False).tokens == [8]


def test_rows_reach_the_csv_and_progress_reaches_stderr_as_points_finish(
    tmp_path, capfd, monkeypatch
):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # without tqdm: a line per point
    path = tmp_path / "rows.csv"
    progress = cli._Progress(2, True, str(path), {"device": report.INTERPRETER})
    progress({"mode": "normal", "ranks": 2, "tokens": 4, "dispatch_us": 1.5})
    assert report.read_csv(path) == [
        {
            "mode": "normal",
            "ranks": 2,
            "tokens": 4,
            "dispatch_us": 1.5,
            "device": report.INTERPRETER,
        }
    ]
    progress({"mode": "normal", "ranks": 2, "tokens": 8, "dispatch_us": 2.5, "late": 1})
    assert [r["tokens"] for r in report.read_csv(path)] == [4, 8]  # "late" waits for the end
    out, err = capfd.readouterr()
    assert out == "" and "point 2/2 done: ranks 2, tokens 8" in err


def test_a_missing_plotting_extra_stops_the_run_before_it_starts(monkeypatch, capfd):
    def missing():
        raise RuntimeError("needs matplotlib: pip install matplotlib")

    def no_run(*args, **kwargs):
        raise AssertionError("ranks started")

    monkeypatch.setattr(report, "require_matplotlib", missing)
    monkeypatch.setattr(cli, "spawn", no_run)
    assert cli.main(["normal", "--ranks", "2", "--plot", "normal.png"]) == 2
    assert "--plot needs matplotlib: pip install matplotlib" in capfd.readouterr().err


def test_overlap_start_must_be_known():
    """``--start`` takes host and queued only, refused before any rank starts."""
    with pytest.raises(SystemExit, match="--start: later"):
        cli.main(["overlap", "--ranks", "2", "--start", "host,later"])
