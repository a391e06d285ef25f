"""benchmarks.harness: fractions of the floor, speedups, cells, tables, the environment line, JSON, the page cache."""

import datetime
import json
import os

import pytest

from benchmarks.harness import (
    Result, cached_fraction, failure_note, format_environment, format_value, fraction_of_floor, markdown_table, report,
    sequential_read_s, speedup, table_rows, wall_ms,
)  # fmt: skip


def test_fraction_of_floor_is_floor_over_time_and_rate_over_peak():
    assert fraction_of_floor(0.216, 0.127, "ms") == pytest.approx(0.127 / 0.216)  # RESULTS.md: 59%
    assert fraction_of_floor(1273.0, 1425.0, "TFLOP/s") == pytest.approx(1273 / 1425)
    assert fraction_of_floor(0.44, 1.15, "GB/s") == pytest.approx(0.44 / 1.15)
    assert fraction_of_floor(None, 0.127, "ms") is None
    assert fraction_of_floor(0.216, None, "ms") is None


def test_speedup_is_peer_over_time_and_rate_over_peer_rate():
    assert speedup(40.92, 69.92, "ms") == pytest.approx(69.92 / 40.92)  # the MLP's 1.71x
    assert speedup(1273.0, 692.0, "TFLOP/s") == pytest.approx(1273 / 692)
    assert speedup(1.0, None, "ms") is None


@pytest.mark.parametrize(
    ("value", "text"),
    [(68.57, "68.6"), (3.646, "3.65"), (0.216, "0.216"), (0.0797, "0.0797"), (1273.4, "1273"), (1.2e-5, "1.20e-05"),
     (0.0, "0"), (None, "-"), (12, "12"), ("yes", "yes")],
)  # fmt: skip
def test_cells_read_like_the_results_tables(value, text):
    assert format_value(value) == text


def test_table_keeps_the_columns_some_row_fills_in_order():
    rows = [
        Result("current", 0.216, 0.127, peer=2.18, peer_name="eager", extra={"host us": 234.0, "exact": "yes"}),
        Result("block", None, 0.129, extra={"exact": "yes"}, note="unavailable"),
    ]
    columns, cells = table_rows(rows)
    assert columns == ["case", "measured ms", "floor ms", "of floor", "peer ms", "peer is", "vs peer", "host us",
                       "exact", "note"]  # fmt: skip  (no "provider": no row names one)
    assert cells[0] == ["current", "0.216", "0.127", "59%", "2.18", "eager", "10.09x", "234", "yes", "-"]
    assert cells[1][:4] == ["block", "-", "0.129", "-"]


def test_mixed_units_go_into_the_cells():
    columns, cells = table_rows([Result("save", 0.44, 1.15, unit="GB/s"), Result("convert", 4.57, 6.25, unit="s")])
    assert columns[1:4] == ["measured", "floor", "of floor"]
    assert cells[0][1:4] == ["0.44 GB/s", "1.15 GB/s", "38%"]
    assert cells[1][3] == "137%"  # the page cache beat the disk floor (RESULTS.md, bench_convert)


def test_markdown_table_has_a_header_a_rule_and_one_line_a_row():
    lines = markdown_table([Result("a", 1.0, 2.0), Result("b", 3.0, 1.5)]).splitlines()
    assert len(lines) == 4
    assert all(line.startswith("|") and line.endswith("|") for line in lines)
    assert set(lines[1]) <= {"|", "-", ":", " "}
    assert lines[2].split("|")[1].strip() == "a"


def test_environment_line_names_date_device_versions_commit_and_command():
    when = datetime.datetime(2026, 12, 2, 5, 7, tzinfo=datetime.timezone.utc)
    line = format_environment(when, "1x NVIDIA H200", {"torch": "2.11.0", "triton": "3.6.0"}, "",
                              ["benchmarks/bench/bench_gemm.py", "--size", "4096"])  # fmt: skip
    assert line == ("2026-12-02 05:07 UTC, 1x NVIDIA H200, torch 2.11.0, triton 3.6.0, commit unknown (+ working tree), "
                    "`python3 benchmarks/bench/bench_gemm.py --size 4096`")  # fmt: skip


def test_report_prints_the_table_and_writes_the_rows_as_json(tmp_path, capsys):
    path = tmp_path / "rows.json"
    report("bench_x", [Result("copy", 0.129, 0.127, extra={"TB/s": 4.15})], str(path), ["- a note"])
    out = capsys.readouterr().out
    assert out.startswith("## bench_x\n") and "| copy" in out and out.rstrip().endswith("- a note")
    document = json.loads(path.read_text())
    assert document["title"] == "bench_x" and "UTC" in document["environment"]
    (row,) = document["results"]
    assert row["measured"] == 0.129 and row["extra"] == {"TB/s": 4.15}
    assert row["fraction"] == pytest.approx(0.127 / 0.129)


def test_a_failure_note_names_the_innermost_error_by_its_first_line():
    try:
        try:
            raise NotImplementedError("quantize_nvfp4 has no custom op yet\nmore")
        except NotImplementedError as inner:
            raise RuntimeError("Observed exception\npages of hints") from inner
    except RuntimeError as error:
        note = failure_note("NVFP4, compiled", error)
    assert note == "NVFP4, compiled: failed (NotImplementedError: quantize_nvfp4 has no custom op yet)"


def test_wall_ms_runs_before_each_timed_call_and_returns_the_median(monkeypatch):
    clock = iter([0.0, 0.001, 1.0, 1.005, 2.0, 2.003])  # timed calls of 1, 5 and 3 ms
    monkeypatch.setattr("benchmarks.harness.time.perf_counter", lambda: next(clock))
    calls = []
    ms = wall_ms(lambda: calls.append("fn"), repeats=3, warmup=1, before=lambda: calls.append("before"))
    assert ms == pytest.approx(3.0)
    assert calls == ["fn", "before", "fn", "before", "fn", "before", "fn"]


def test_a_file_just_read_is_all_in_the_page_cache(tmp_path):
    """mincore through cached_fraction: every page of a file read a moment ago is cached (0 if the address were wrong)."""
    path = tmp_path / "data"
    path.write_bytes(os.urandom(3 << 20) + b"tail")  # a last partial page
    assert sequential_read_s([path], chunk=1 << 20) > 0
    assert cached_fraction([path]) == 1.0
