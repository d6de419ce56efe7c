"""The scale-out tool's bookkeeping (its runs need a GPU per replica): where each search starts, the capacity row
it reports per replica count, the scaling per step."""

from __future__ import annotations

import importlib.util

from tests.conftest import REPO_ROOT

_spec = importlib.util.spec_from_file_location("scale_out", REPO_ROOT / "tools" / "scale_out.py")
scale_out = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale_out)


def _row(rate: float, p95: float, failed: int = 0) -> dict:
    return {"rate": rate, "first_packet_ms": {"p50": p95 / 2, "p95": p95, "p99": p95 * 1.1}, "underrun_events": 0,
            "failed": failed, "audio_s_per_s": rate * 10, "ok": 10, "sent": 10, "rejected": 0, "errors": []}


def _report(best: float | None, failed_at: float | None, rows: list[dict]) -> dict:
    return {"rows": rows, "capacity": {"best_rate": best, "failed_at": failed_at}}


def test_a_search_starts_from_the_last_capacity_scaled_by_the_replicas():
    assert scale_out.start_rate({}, 1, 4.0) == 4.0
    assert scale_out.start_rate({1: 6.0}, 2, 4.0) == 12.0
    assert scale_out.start_rate({1: 6.0, 2: None}, 4, 4.0) == 24.0  # a count where nothing passed gives no hint


def test_the_summary_reports_the_row_at_each_capacity_and_the_scaling():
    one = _report(6.0, 8.0, [_row(4.0, 300), _row(8.0, 900), _row(6.0, 480)])
    two = _report(11.4, 12.0, [_row(12.0, 700), _row(11.4, 495)])
    none = _report(None, 2.0, [_row(2.0, 800, failed=1)])
    s = scale_out.summary({1: one, 2: two, 4: none}, None)
    assert s["capacity"][1]["rate"] == 6.0 and s["capacity"][1]["first_packet_ms"]["p95"] == 480
    assert s["capacity"][2]["failed_at"] == 12.0 and s["capacity"][2]["audio_s_per_s"] == 114.0
    assert s["capacity"][4]["rate"] is None and s["capacity"][4]["first_packet_ms"] is None
    assert s["scaling"] == {"1->2": 1.9}  # no ratio to a count where nothing passed
    scale_out.print_summary(s)  # prints a count with no capacity too
