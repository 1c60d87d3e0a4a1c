"""``tritonep bench report``: the tables of BENCHMARKS.md from CSVs, without running a benchmark."""

from tritonep.bench import cli, report


def test_report_joins_csvs_and_keeps_the_columns_asked_for(tmp_path):
    rows = [
        {"tokens": 4096, "transport": "copy", "dispatch_us": 775.34, "combine_us": 916.8},
        {"tokens": 4096, "transport": "nvshmem", "dispatch_us": 902.34, "combine_us": 1183.0},
    ]
    for i, row in enumerate(rows):
        report.write_csv([row], tmp_path / f"{i}.csv")
    md = tmp_path / "BENCH.md"
    args = ["report", str(tmp_path / "0.csv"), str(tmp_path / "1.csv"), "--markdown", str(md)]
    assert cli.main([*args, "--section", "t", "--columns", "transport,dispatch_us,run"]) == 0
    table = md.read_text().split("<!-- bench:t -->\n")[1].split("\n<!-- /bench:t -->")[0]
    assert table.splitlines() == [
        "| to other nodes | dispatch us | run |",  # unknown columns keep their CSV name
        "|---|---|---|",
        "| copy | 775.3 |  |",
        "| nvshmem | 902.3 |  |",
    ]
