"""The benchmark's CPU smoke run: every configuration measured, table printed, JSON written."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import time

import pytest

from cosyvoice_opt.bench.cli import main
from tests.conftest import REPO_ROOT


def test_bench_smoke_tiny_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    t0 = time.perf_counter()
    assert main(["--random", "tiny", "--device", "cpu", "--precision", "fp32", "--concurrency", "1,2",
                 "--tokens", "30", "--json", str(out)]) == 0
    assert time.perf_counter() - t0 < 60
    data = json.loads(out.read_text())
    rows = data["results"]
    assert [(r["concurrency"], r["stream"]) for r in rows] == [(1, True), (1, False), (2, True), (2, False)]
    for r in rows:
        assert 0 < r["first_packet_p50_ms"] <= r["first_packet_p95_ms"]
        assert r["audio_s"] > 0 and r["audio_s_per_s"] > 0 and r["rtf_p50"] > 0
        assert r["stage_s"]["llm"] > 0 and r["stage_s"]["flow"] > 0 and r["stage_s"]["hift"] > 0
        assert r["gpu_util_mean"] is None and r["peak_mem_gb"] is None  # n/a on CPU
        assert r["prompt_cache_hit_ms"] >= 0
        # 30 forced tokens = 1.2 s of speech per request (2 mel frames of 480 samples per token at 24 kHz)
        # low concurrencies run whole rounds until 8 requests were measured
        assert r["requests"] == r["concurrency"] * -(-8 // r["concurrency"])
        assert abs(r["audio_s"] / r["requests"] - 30 * 2 * 480 / 24000) < 1e-6
    assert data["engines"]["fp32"]["model"] == "random tiny"
    assert "fp50ms" in capsys.readouterr().out


def test_the_serving_profile_times_every_stage_tiny_cpu():
    """tools/profile_serve.py wraps the engine's stages (a new voice's frontend's too) by name: one renamed in the
    engine fails here, not on the GPU machine."""
    proc = subprocess.run([sys.executable, "tools/profile_serve.py", "--random", "tiny", "--device", "cpu", "--rates",
                           "2", "--duration", "4"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for stage in ("round", "encoder", "flow call", "hift call", "frontend", "tokens", "log-mel", "llm step",
                  "llm launch"):
        assert re.search(rf"^  {stage} +[0-9.]+/s", proc.stdout, re.MULTILINE), (stage, proc.stdout[-3000:])


def test_soak_over_http_tiny_cpu(tmp_path):
    """CI-sized soak: 4 clients for 10 s against the in-process API on the tiny model; no failure, no leak.

    Run in a fresh process, so the live-tensor count is the soak server's own and not other tests' engines'."""
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, "-m", "cosyvoice_opt", "bench", "--soak", "10", "--concurrency", "4", "--random", "tiny",
         "--device", "cpu", "--precision", "fp32", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    assert result.returncode == 0 and report["failed"] == 0, report["errors"]
    assert report["completed"] >= 4 and report["server"] == "in-process" and report["model"] == "random tiny"
    assert 0 < report["first_byte_ms"]["p50"] <= report["total_ms"]["p99"]
    assert report["wall_s"] < 10 + 120  # stops starting requests at 10 s; the last ones finish
    # a leak shows as live tensors that outlive their request (RSS moves with allocator arenas; it is reported)
    assert report["end"]["live_tensors"] <= report["start"]["live_tensors"] + 20, report
    assert report["engine_stats"]["running"] == 0 and report["engine_stats"]["waiting"] == 0
    samples = report["samples"]  # memory over time: at least start and end, in order, with the engine's counters
    assert len(samples) >= 3 and [x["t_s"] for x in samples] == sorted(x["t_s"] for x in samples)
    assert samples[-1]["completed"] >= samples[0]["completed"] + report["completed"]
    # where host memory could go besides tensors (an in-process server): Python objects and threads, per sample
    assert all(x["python_blocks"] > 1000 and x["threads"] >= 3 for x in samples)
    if sys.platform == "linux" and "glibc" in platform.libc_ver()[0]:  # malloc's own view: in use vs free but kept
        assert all(x["heap_in_use_mb"] > 0 and x["heap_free_mb"] >= 0 for x in samples)
    assert isinstance(report["object_growth"], dict) and all(v > 0 for v in report["object_growth"].values())
    assert report["rss_growth_second_half_mb"] == samples[-1]["rss_mb"] - next(
        x["rss_mb"] for x in samples if x["t_s"] >= samples[-1]["t_s"] / 2)
    assert "refused as busy (HTTP 503), 0 failed" in result.stdout and "second half" in result.stdout
    assert report["refused"] == report["engine_stats"]["rejected"]  # the clients count what the engine refused


def test_soak_samples_never_walk_the_gc_while_requests_run(monkeypatch):
    """`gc.get_objects()` next to running requests breaks them (CPython gh-107137: a tuple still being built by
    `tuple(generator)` gets handed out; a soak on the H200 lost a request to it), so a sample must not call it."""
    import gc

    from cosyvoice_opt.bench import soak

    def forbidden(*args, **kwargs):
        raise AssertionError("gc.get_objects() during the load")

    monkeypatch.setattr(gc, "get_objects", forbidden)
    sample = soak.process_reading(0.0, "cpu", lambda: {"completed": 3, "flow_graph_captures": 0, "running": 1})
    assert sample["python_blocks"] > 0 and sample["threads"] >= 1
    assert sample["completed"] == 3 and "running" not in sample


def test_a_soak_counts_a_refusal_as_busy_apart_from_failures():
    """Past its capacity a server refuses with HTTP 503 by design: the soak tells that from a failure (an error, a
    short answer), which is what makes it exit 1."""
    import httpx

    from cosyvoice_opt.bench import soak

    def server(status: int, body: bytes):
        return httpx.Client(base_url="http://soak", transport=httpx.MockTransport(
            lambda request: httpx.Response(status, content=body, headers={"retry-after": "3"})))

    with server(503, b'{"error": {"code": "server_busy"}}') as client, pytest.raises(soak.Busy):
        soak._one(client, 0)
    with server(500, b'{"error": {}}') as client, pytest.raises(RuntimeError, match="HTTP 500"):
        soak._one(client, 0)
    with server(200, b"\0" * 4) as client, pytest.raises(RuntimeError, match="short response"):
        soak._one(client, 1)
    with server(200, b"\0" * 4800) as client:
        first, total = soak._one(client, 1)
        assert 0 <= first <= total
