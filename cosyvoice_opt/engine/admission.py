"""Admission: a request starts only when everything it will need is free, and waits in a bounded FIFO otherwise.

What a request holds from its admission to its last audio: one audio stream (its flow and HiFT state, one slot of
the flow page pool) and the flow pages of its longest text piece at its maximum length, prompt included (streaming
only: whole clips run the full-attention flow, which keeps no pages). Its KV slot is the scheduler's (held while
the LLM decodes it). Reserving the maximum up front means the pool can never run out under an admitted stream, so
no stream ever leaves the fast path or runs out of memory half-way, whatever the arrival rate.

Streams already playing come first, with no time limit: a newcomer waits while a playing stream has less than
`min_slack` seconds of audio left (the vocoder is behind; the newcomer's prompt and first chunk would take its time).
Past the capacity the backlog stays in the queue, whose bound turns it into clean refusals, instead of going to the
listeners. A stream whose audio waits for its streamed text is not behind for this: its client is.

Streamed text has no length until its text ends, so its reservation grows instead: it starts with the flow pages
for `ROOM_FIRST_TOKENS` speech tokens after the prompt, and before its decode would pass what it holds it takes
`ROOM_GROW_TOKENS` more from the pages no one has reserved (`grow`). While there are none its row waits (its
listener's audio pauses) until another request gives pages back; after `ROOM_WAIT_S` it fails with a clear error,
so that requests all waiting on one another cannot hang.

The queue is bounded in time: a request that cannot start within `max_queue_wait` seconds is refused as busy
(`EngineBusy`). A newcomer is refused at once when the queue's head has already waited half that bound: the queue is
moving too slowly for it (FIFO: it would wait longer than the head has). A burst on an idle engine, whose head has
waited only a step, is queued. A bound of 0 means no queue: a request starts at the engine's next admission or is
refused then (the queue holds it only until that step).
"""

from __future__ import annotations

ADMIT_MIN_SLACK_S = 0.5  # newcomers wait while a playing stream has less audio than this left
ROOM_FIRST_TOKENS = 250  # speech tokens (10 s) a streamed-text request's first reservation covers after its prompt
ROOM_GROW_TOKENS = 125  # what each growth adds (5 s)
ROOM_WAIT_S = 10.0  # how long a streamed-text row may wait for pages to grow into before it fails


class Admission:
    """Pages and audio streams of the admitted requests (engine thread admits; the vocoder thread releases)."""

    def __init__(self, pages: int, streams: int, max_queue_wait: float,
                 min_slack: float = ADMIT_MIN_SLACK_S) -> None:
        self.pages = pages
        self.streams = streams
        self.max_queue_wait = max_queue_wait
        self.min_slack = min_slack
        self.pages_held = 0
        self.streams_held = 0

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

    def holds(self, playing_slack: float) -> bool:
        """Whether a newcomer gives way to a playing stream with `playing_slack` seconds of audio left."""
        return playing_slack < self.min_slack

    def refuse_at_once(self, head_waited: float) -> bool:
        """A newcomer behind a head that has waited `head_waited` seconds would not start in time. With no queue
        (a bound of 0) none is refused here: the next admission starts it or refuses it."""
        return self.max_queue_wait > 0 and head_waited >= self.max_queue_wait / 2

    def retry_after(self, head_waited: float) -> float:
        """A hint for a refused client, in seconds: about as long as the queue's head has waited, at least 1."""
        return max(1.0, min(head_waited, self.max_queue_wait))
