"""A bidirectional-streaming request in the continuous batch: text arrives while its speech is decoded.

The control flow is `models.bistream.BistreamPlan` (upstream's `inference_bistream`); this module is where a
request's row stands between the scheduler's steps. A decode cycle starts when the plan has an input (5 text tokens,
or the prompt blocks, or at the end the rest of the text and task_id): the scheduler feeds it into the request's
KV slot (a prefill when the slot is empty, else `LLMRunner.extend_many`), then decodes the row with everyone else.
Fill tokens come only from the plan's schedule (every 15 speech tokens), so the number of rows of a text cycle is
known when it starts; the row then parks: it keeps its slot, writes nothing and gets no token, until text arrives.

Engine deviations from upstream, for a sampler other than the fixtures' stand-in: in the text phase every stop id
is masked (upstream masks only eos, accepts a sampled fill and raises on 6562); in the final phase a sampled 6562
or fill ends the speech like eos (upstream raises). The final phase is bounded by the KV slot.
With `force` (benchmarks, as `force_tokens` for a whole text: random weights rarely sample eos), the final phase
ignores eos and ends once the speech has `force` tokens, or at its start when the text already made that many.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable

from cosyvoice_opt.frontend.text_split import has_speakable
from cosyvoice_opt.models.bistream import BistreamPlan, Segment
from cosyvoice_opt.types import TextStream


class BistreamFeed:
    """One request's plan, its arrived-but-unread text and its row's cycle (engine thread only, except `source`)."""

    def __init__(self, plan: BistreamPlan, source: TextStream, tokenize: Callable[[str], list[int]],
                 idle_timeout: float, force: int | None = None) -> None:
        self.plan = plan
        self.force = force
        self.speech = 0  # speech tokens emitted
        self.source = source
        self.tokenize = tokenize
        self.idle_timeout = idle_timeout
        self.items: deque[int] = deque()  # text ids not yet pushed: one id per plan item, as upstream's frontend
        self.rows_left = 0  # decode rows still to launch in this cycle
        self.expect = 0  # tokens this cycle delivers (its feed's and its rows')
        self.got = 0  # of them delivered
        self.timed_out = False  # the text stopped arriving and the request was ended by `idle_timeout`
        self.no_text = False  # the text ended (or stopped arriving) with nothing to speak: the request fails
        self._speakable = False  # a letter or digit has arrived
        self.text_tokens = 0
        self._piece_ends: list[int] = []  # text_tokens after each push
        self._input_text_at: float | None = None  # when the text of the cycle input `poll` offers arrived
        self._cycle_text: list[tuple[int, float]] = []  # per started cycle: (speech tokens before it, that time)

    @property
    def live(self) -> bool:
        """The row decodes in the next step."""
        return self.rows_left > 0

    @property
    def paced_by_text(self) -> bool:
        """Its speech is decoded as its text arrives (15 tokens per 5 text tokens), until the text ends."""
        return self.plan.phase == "text"

    @property
    def waits_for_text(self) -> bool:
        """The row is parked until more text arrives: a pause in its audio is its client's, not the server's."""
        return self.paced_by_text and not self.plan.decoding

    def deadline(self) -> float | None:
        """When the text counts as stopped (monotonic clock), while the row waits for text; None otherwise."""
        if not self.waits_for_text or self.items or self.source.pending():
            return None
        return self.source.last_push + self.idle_timeout

    def ready(self, now: float) -> bool:
        """Something for `poll` to do: arrived text, the end of it, or the idle deadline passed."""
        if not self.waits_for_text:
            return False
        deadline = self.deadline()
        return deadline is None or now >= deadline

    def poll(self, now: float) -> list[Segment] | None:
        """Between steps, while the row is parked: move arrived text into the plan, one id per item, until a cycle
        starts; the text ends when the source is closed or idle too long. Returns the cycle's first input, if any,
        and again at the next poll while no step has fed it (`start_cycle`): a step that could not launch it (out of
        memory, say) loses nothing."""
        if self.plan.done:
            return None
        if self.plan.decoding:  # a cycle under way, or one started that no step has fed yet
            return self.plan.input() if self.got >= self.expect else None
        pieces, closed = self.source.take()
        for piece in pieces:
            self._speakable = self._speakable or has_speakable(piece)
            ids = self.tokenize(piece)
            self.items.extend(ids)
            self.text_tokens += len(ids)
            self._piece_ends.append(self.text_tokens)
        while self.items and not self.plan.decoding:
            self.plan.push([self.items.popleft()])
        if not self.plan.decoding and not self.items and self.plan.phase == "text":
            idle = now - self.source.last_push >= self.idle_timeout
            if closed or idle:
                self.timed_out = idle and not closed
                if not self._speakable:  # speech from no text would be the model's noise
                    self.no_text = True
                    return None
                self.plan.finish()
        if not self.plan.decoding:
            return None
        self._input_text_at = self._text_arrival(closed, now)
        if self.source.unlocked_at is None:
            self.source.unlocked_at = self._input_text_at
        return self.plan.input()

    def _text_arrival(self, closed: bool, now: float) -> float:
        """When the text that the cycle now under way (or about to start) waited for arrived: the push holding the
        last id the plan took, or the end of the text when the plan started its final phase on it (`now` when
        the text stopped arriving instead)."""
        source = self.source
        if self.plan.phase == "text":
            return source.push_times[bisect_left(self._piece_ends, self.text_tokens - len(self.items))]
        return source.closed_at if closed and source.closed_at is not None else now

    def start_cycle(self, positions_after_feed: int, max_seq: int) -> None:
        """The cycle's input goes into the slot now; `positions_after_feed` is the slot's length after it. A text
        cycle decodes up to its fill; the final phase until eos or the slot's end (one position kept free: decode
        runs a row one step ahead)."""
        plan = self.plan
        if plan.phase == "text":
            self.rows_left = plan.next_fill - len(plan.out)
        else:
            self.rows_left = max(0, max_seq - 1 - positions_after_feed)
        self.expect, self.got = self.rows_left + 1, 0
        if self._input_text_at is not None:
            self._cycle_text.append((self.speech, self._input_text_at))

    def text_arrival_for(self, token: int) -> float | None:
        """When the text arrived that the cycle making speech token number `token` (from 0) started on: what
        audio ending with that token waited for last. None before any cycle."""
        before = [at for speech, at in self._cycle_text if speech <= token]
        return before[-1] if before else None

    def launched(self) -> None:
        self.rows_left -= 1

    def take(self, tokens: list[int], emit: Callable[[int], None]) -> bool:
        """Delivered tokens of this cycle, in order (the forced fill replaces its row's token): speech is `emit`ted.
        Returns True when the speech has ended (eos, or the final phase reached the slot's end)."""
        plan = self.plan
        for token in tokens:
            if plan.done or not plan.decoding:
                return plan.done  # a row decoded past the end (eos is known one step late): dropped
            if plan.phase == "final" and self.force is not None and self.speech >= self.force:
                plan.phase, plan.decoding = "done", False
                return True
            forced = plan.forced()
            if forced is not None:
                token = forced
            elif plan.phase == "final" and token >= plan.n_ids:
                token = plan.eos
            self.got += 1
            if plan.accept(token):
                self.speech += 1
                emit(token)
            if plan.phase == "final" and self.got >= self.expect and not plan.done:
                plan.phase, plan.decoding = "done", False  # the slot is full
        return plan.done
