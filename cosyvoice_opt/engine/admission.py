"""Admission: a request starts only when everything it will need is free and the vocoder has time for it, and waits
in a bounded FIFO otherwise.

What a request holds from its admission to its last audio: one audio stream (its flow and HiFT state, one slot of
the flow page pool) and the flow pages of its longest text piece at its maximum length, prompt included (streaming
only: whole clips run the full-attention flow, which keeps no pages). Its KV slot is the scheduler's (held while
the LLM decodes it). Reserving the maximum up front means the pool can never run out under an admitted stream, so
no stream ever leaves the fast path or runs out of memory half-way, whatever the arrival rate.

Streams already playing come first, with no time limit: a newcomer waits while the vocoder could not come back in
time to the playing stream closest to running dry, or to the newcomer itself once its first chunk plays (a young
stream is the first to run dry: its first chunk ends a round and carries at least `FIRST_AUDIO_S` of audio)
(`VocoderLoad`, `Admission.holds`). Coming back takes the round in progress and the next (`ADMIT_ROUNDS` of its
recent round time, measured), plus a round for every `FIRST_AUDIO_PER_ROUND` admitted requests whose first audio is
not out yet (theirs goes ahead of every listener's), and never less than `min_slack`; the vocoder's recent rounds
are those since it last had nothing to do (an idle vocoder holds no one back). So the more the vocoder's rounds grow
with its load, the earlier admissions stop, and a burst of newcomers in one step is cut where their first audio
would make a listener wait. Past the capacity the backlog stays in the queue, whose bound turns it into clean
refusals, instead of going to the listeners. A stream whose audio waits for its streamed text is not behind for
this: its client is.

Streamed text has no length until its text ends, so its reservation grows instead: it starts with the flow pages
for `ROOM_FIRST_TOKENS` speech tokens after the prompt, and before its decode would pass what it holds it takes
`ROOM_GROW_TOKENS` more from the pages no one has reserved (`grow`). While there are none its row waits (its
listener's audio pauses) until another request gives pages back; after `ROOM_WAIT_S` it fails with a clear error,
so that requests all waiting on one another cannot hang.

The queue is bounded in time: a request that cannot start within `max_queue_wait` seconds is refused as busy
(`EngineBusy`) as soon as the queue's measured pace says so (`expected_start`, `late`), and at the bound at the
latest. A request starts once each request ahead of it, and then itself, has waited at the head about as long as
the recent admitted requests did (`pace`, over the last `PACE_WINDOW_S`), and at least as long as the present head
has already waited. A newcomer is judged at the call; the queued requests again at every engine step, from the
back, since the pace may slow after they were queued (while the vocoder holds newcomers back), up to the first
that would start in time: no one is refused while a later one stays queued. An engine thread with nothing else to
do wakes for it when the last one would turn late (`late_in`). The head is refused only at the bound
(the next admission decides), so a newcomer into an empty queue is always queued, and a burst on an idle engine,
whose head has waited only a step, is too. A bound of 0 means no queue: a request starts at the engine's next
admission or is refused then (the queue holds it only until that step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

ADMIT_MIN_SLACK_S = 0.5  # newcomers wait while a playing stream has less audio than this left, however fast rounds are
ADMIT_ROUNDS = 2  # rounds the vocoder may need to come back to a listener: the one in progress and the next
FIRST_AUDIO_PER_ROUND = 16  # first chunks one round makes ahead of the listeners (one launch-bound flow call)
FIRST_AUDIO_S = 0.8  # the least audio a first chunk carries: 25 tokens (1 s of mel) less HiFT's 8-frame look-back
PACE_WINDOW_S = 10.0  # the queue's pace is measured over the admissions of this many seconds ...
PACE_SAMPLES = 64  # ... at most this many of them
ROOM_FIRST_TOKENS = 250  # speech tokens (10 s) a streamed-text request's first reservation covers after its prompt
ROOM_GROW_TOKENS = 125  # what each growth adds (5 s)
ROOM_WAIT_S = 10.0  # how long a streamed-text row may wait for pages to grow into before it fails


@dataclass(frozen=True)
class VocoderLoad:
    """The vocoder's state as admission reads it (the vocoder thread writes it; read without its lock)."""

    slack: float = float("inf")  # seconds of audio the playing stream closest to running dry has left (inf: none)
    round_s: float = 0.0  # how long its rounds take now (the longest of its recent ones)
    starting: int = 0  # admitted requests whose first audio is not out yet


class Admission:
    """Pages and audio streams of the admitted requests (engine thread admits; the vocoder thread releases), the
    vocoder's headroom, and the queue's pace."""

    def __init__(self, pages: int, streams: int, max_queue_wait: float,
                 min_slack: float = ADMIT_MIN_SLACK_S) -> None:
        self.pages = pages
        self.streams = streams
        self.max_queue_wait = max_queue_wait
        self.min_slack = min_slack
        self.pages_held = 0
        self.streams_held = 0
        self._at_head: deque[tuple[float, float]] = deque(maxlen=PACE_SAMPLES)  # (admitted at, s it was the head)

    def fits(self, pages: int) -> bool:
        return self.streams_held < self.streams and self.pages_held + pages <= self.pages

    def take(self, pages: int) -> None:
        self.pages_held += pages
        self.streams_held += 1

    def grow(self, pages: int) -> bool:
        """Add `pages` to an admitted request's reservation if no one has reserved them; whether it did."""
        if self.pages_held + pages > self.pages:
            return False
        self.pages_held += pages
        return True

    def give_back(self, pages: int) -> None:
        self.pages_held -= pages
        self.streams_held -= 1

    def holds(self, load: VocoderLoad, admitted_now: int = 0) -> bool:
        """Whether a newcomer gives way: the vocoder, with `admitted_now` more newcomers starting than `load`
        counts, could not come back in time to the playing stream closest to running dry, or to the newcomer once
        its first audio plays (`FIRST_AUDIO_S` after the end of a round)."""
        starting = load.starting + admitted_now
        if load.slack == float("inf") and not starting:  # nothing plays or starts: the vocoder is free for it
            return False
        need = load.round_s * (ADMIT_ROUNDS + starting / FIRST_AUDIO_PER_ROUND)
        return min(load.slack, load.round_s + FIRST_AUDIO_S) < max(self.min_slack, need)

    def started(self, now: float, at_head: float) -> None:
        """A request was admitted at `now` after `at_head` seconds at the head of the queue."""
        self._at_head.append((now, at_head))

    def pace(self, now: float) -> float:
        """Seconds a request waits at the head of the queue, on average over the recent admissions (0: none)."""
        recent = [s for t, s in self._at_head if t >= now - PACE_WINDOW_S]
        return sum(recent) / len(recent) if recent else 0.0

    def expected_start(self, ahead: int, head_for: float, now: float) -> float:
        """Seconds until a request starts behind `ahead` waiting requests whose head has been at the head for
        `head_for` seconds (0 with none ahead: the next admission decides)."""
        return (ahead + 1) * max(self.pace(now), head_for) if ahead else 0.0

    def late(self, expected_start: float, waited: float = 0.0) -> bool:
        """A request that has waited `waited` s (0: a newcomer) and is expected to start in `expected_start` s would
        not start in time. With no queue (a bound of 0) none is refused here: the next admission starts it or
        refuses it."""
        return self.max_queue_wait > 0 and waited + expected_start > self.max_queue_wait

    def late_in(self, ahead: int, head_for: float, waited: float, now: float) -> float:
        """Seconds from `now` until a request that has waited `waited` s behind `ahead` waiting requests is `late`
        if no one starts meanwhile (its head waits on, at the present pace; inf: only its bound refuses it)."""
        if not ahead or self.max_queue_wait <= 0:
            return float("inf")
        left = self.max_queue_wait - waited
        by_pace = left - (ahead + 1) * self.pace(now)
        by_head = (left - (ahead + 1) * head_for) / (ahead + 2)  # the head's wait grows with it
        return max(0.0, min(by_pace, by_head))

    def retry_after(self, expected_start: float, waited: float = 0.0) -> float:
        """A hint for a refused client, in seconds: about when the queue would have room for it again (it drains at
        its pace: by as much as it would have started past the bound), at least 1 and at most the bound."""
        return max(1.0, min(waited + expected_start - self.max_queue_wait, self.max_queue_wait))
