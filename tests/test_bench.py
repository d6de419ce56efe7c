"""The benchmark's CPU smoke run: every configuration measured, table printed, JSON written."""

from __future__ import annotations

import json
import time

from cosyvoice_opt.bench import main


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
        assert abs(r["audio_s"] / r["concurrency"] - 30 * 2 * 480 / 24000) < 1e-6
    assert data["engines"]["fp32"]["model"] == "random tiny"
    assert "fp50ms" in capsys.readouterr().out
