"""What the vocoder thread has done since the engine started. The counters outlive a precision switch (which
rebuilds the vocoder and its flow runner), so they only grow: their rates over a window show where the time goes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VocoderCounters:
    rounds: int = 0  # rounds run (`AudioWorker._collect`)
    chunks: int = 0  # the chunks they made
    busy_s: float = 0.0  # seconds in rounds (each ends with a host sync, so the GPU's time is in it)
    flow_calls: int = 0  # paged flow calls (`FlowRunner.run`), prompt-prefix passes included
    flow_rows: int = 0  # the real rows they carried
    prefix_calls: int = 0  # the prompt-prefix passes among them
