"""What the vocoder thread has done since the engine started, and where both threads' time went over a window.

The counters outlive a precision switch (which rebuilds the vocoder and its flow runner), so they only grow; their
rates over a window (`stage_use`, read off `Engine.stats` at both ends) show which thread bounds the throughput."""

from __future__ import annotations

from dataclasses import dataclass

# The `Engine.stats` keys of where the time goes: the LLM's (scheduler) and the vocoder's (`VocoderCounters`)
STAGE_COUNTERS = ("llm_steps", "llm_rows", "llm_busy_seconds", "vocoder_rounds", "vocoder_chunks",
                  "vocoder_busy_seconds", "flow_calls", "flow_rows", "flow_prefix_calls", "flow_prefix_rides")


@dataclass
class VocoderCounters:
    rounds: int = 0  # rounds run (`AudioWorker._collect`)
    chunks: int = 0  # the chunks they made
    busy_s: float = 0.0  # seconds in rounds (each ends with a host sync, so the GPU's time is in it)
    flow_calls: int = 0  # paged flow calls (`FlowRunner.run`), prompt-prefix passes included
    flow_rows: int = 0  # the real rows they carried
    prefix_calls: int = 0  # the prompt-prefix passes among them
    prefix_rides: int = 0  # prompt prefixes computed as extra rows of a round's flow call (no call of their own)


def stage_use(before: dict | None, after: dict | None, window_s: float) -> dict | None:
    """Where the engine's time went over a window, from its counters (`Engine.stats`) at both ends: each thread's
    busy share, the LLM's steps per second and rows per step, the vocoder's rounds per second, chunks per round, flow
    calls per second and rows per call, prompt-prefix calls and prefixes riding along with chunks per second. None
    where the stats lack the counters or went down."""
    if not before or not after or window_s <= 0 or any(k not in before or k not in after for k in STAGE_COUNTERS):
        return None
    d = {k: after[k] - before[k] for k in STAGE_COUNTERS}
    if any(v < 0 for v in d.values()):  # not the same engines at both ends (a cluster's replica left or restarted)
        return None
    return {"llm_busy_pct": 100 * d["llm_busy_seconds"] / window_s,
            "llm_steps_per_s": d["llm_steps"] / window_s,
            "llm_rows_per_step": d["llm_rows"] / d["llm_steps"] if d["llm_steps"] else 0.0,
            "vocoder_busy_pct": 100 * d["vocoder_busy_seconds"] / window_s,
            "rounds_per_s": d["vocoder_rounds"] / window_s,
            "chunks_per_round": d["vocoder_chunks"] / d["vocoder_rounds"] if d["vocoder_rounds"] else 0.0,
            "flow_calls_per_s": d["flow_calls"] / window_s,
            "flow_rows_per_call": d["flow_rows"] / d["flow_calls"] if d["flow_calls"] else 0.0,
            "prefix_calls_per_s": d["flow_prefix_calls"] / window_s,
            "prefix_rides_per_s": d["flow_prefix_rides"] / window_s}
