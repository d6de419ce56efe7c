"""Admission control and the bounded queue: reservations never over-commit, FIFO order, newcomers give way while the
vocoder could not come back to a listener in time (an overload simulation on the scheduler's own code: no listener
runs dry), refusals as busy (at the queue's bound, and as soon as the queue's measured pace says a request would not
start in time: a newcomer at the call, a queued one at the next step, from the back), and a CUDA error that poisons
the GPU fails everything cleanly."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import cosyvoice_opt.engine.scheduler as scheduler_module
from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.engine.admission import FIRST_AUDIO_PER_ROUND, PACE_WINDOW_S, Admission, VocoderLoad
from cosyvoice_opt.engine.faults import is_fatal
from cosyvoice_opt.engine.scheduler import FlowPrompt, Request, Scheduler, TextPiece
from cosyvoice_opt.errors import EngineBusy, EngineDead
from cosyvoice_opt.random_model import random_model
from cosyvoice_opt.types import SynthesisRequest
from tests.conftest import REPO_ROOT
from tests.test_engine import prompt_wav


def _request(pages: int, prefix: int = 10) -> Request:
    piece = TextPiece(torch.arange(prefix - 2), None, 0, 10)
    prompt = FlowPrompt(torch.zeros(1, 0), torch.zeros(1, 0, 80), torch.zeros(1, 192))
    return Request([piece], prompt, stream=True, speed=1.0, seed=0, force_tokens=None, arrival=0.0, frontend_s=0.0,
                   pages=pages)


def _scheduler(pages: int, streams: int = 1 << 10, wait: float = 60.0, batch: int = 1 << 10,
               slack: float | list[float] = float("inf")) -> tuple[Scheduler, list[Request]]:
    """`slack`: the playing streams' least audio left, or a one-item list a test changes as it goes (a vocoder
    whose rounds take no time and with no stream starting)."""
    admitted: list[Request] = []
    box = slack if isinstance(slack, list) else [slack]
    sched = Scheduler(batch, (0,), Admission(pages, streams, wait), on_admit=admitted.append,
                      vocoder_load=lambda now: VocoderLoad(box[0]))
    return sched, admitted


class FakeClock:
    """The scheduler's clock, moved by hand (whole seconds from 1000 add up exactly: a bound is
    reached when it says)."""

    def __init__(self, monkeypatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(perf_counter=lambda: self.now,
                                                                      monotonic=lambda: self.now))


def test_admission_never_over_commits_pages_or_streams():
    """Random arrivals and departures: what the admitted requests hold never exceeds the pool or the streams, the
    queue is served in arrival order, and everything comes back."""
    rng = random.Random(0)
    sched, admitted = _scheduler(pages=40, streams=6)
    held, order = [], []
    for _ in range(400):
        if rng.random() < 0.6:
            req = _request(rng.randint(0, 20))
            order.append(req)
            sched.submit(req)
        elif held:
            done = held.pop(rng.randrange(len(held)))
            sched.release(done)
        before = len(admitted)
        for req in sched._admit(num_slots=1 << 10):
            sched.running.remove(req)  # the LLM side is not under test: free the slot at once
        held += admitted[before:]
        a = sched.admission
        assert a.pages_held == sum(r.pages for r in held) <= 40 and a.streams_held == len(held) <= 6
    assert admitted == order[: len(admitted)]  # FIFO: nobody overtakes the head
    for req in held:
        sched.release(req)
    assert (sched.admission.pages_held, sched.admission.streams_held) == (0, 0)


def test_a_release_twice_gives_back_once():
    sched, admitted = _scheduler(pages=10)
    req = _request(4)
    sched.submit(req)
    sched._admit(num_slots=4)
    sched.release(req)
    sched.release(req)
    assert admitted == [req] and sched.admission.pages_held == 0 and sched.admission.streams_held == 0


def test_newcomers_wait_while_a_playing_stream_is_short_of_audio_until_refused_at_the_bound(monkeypatch):
    """No time limit on giving way: past the capacity the backlog becomes refusals, not listeners running dry."""
    FakeClock(monkeypatch)
    slack = [0.1]
    sched, admitted = _scheduler(pages=10, wait=5.0, slack=slack)
    req = _request(1)
    sched.submit(req)
    assert sched._admit(num_slots=4) == [] and not admitted
    with sched._cond:
        assert sched._admission_timeout(req.queued_at + 1.0) == pytest.approx(0.02)  # looked at again soon
    sched._expire(req.queued_at + 4.9)
    assert sched._admit(num_slots=4) == [] and list(sched.waiting) == [req]  # still giving way after 4.9 s
    sched._expire(req.queued_at + 5.0)
    assert isinstance(req.out.get_nowait(), EngineBusy) and not sched.waiting and sched.rejected == 1
    late = _request(1)
    sched.submit(late)
    slack[0] = 0.6  # the listeners have audio in hand again
    assert sched._admit(num_slots=4) == [late] and admitted == [late]


def test_a_streamed_text_waiting_for_its_text_does_not_hold_newcomers():
    """The playback look skips a streamed text whose row is parked for text with no chunk ready: its pause is its
    client's; the same stream with a chunk ready, or decoding, counts."""
    from types import SimpleNamespace

    from cosyvoice_opt.engine.audio_worker import AudioWorker

    def voc(first_sent: float, feed=None, job=None):
        return SimpleNamespace(first_sent=first_sent, sent_s=1.0, job=job, req=SimpleNamespace(feed=feed))

    worker = AudioWorker.__new__(AudioWorker)
    worker._arrived, worker._round_s = [], 0.0
    starved, decoding = SimpleNamespace(waits_for_text=True), SimpleNamespace(waits_for_text=False)
    worker._active = {0: voc(10.0), 1: voc(5.0, starved)}
    worker._note_playback()
    assert worker.load(0.0).slack == 11.0
    for late in (voc(5.0, starved, job=object()), voc(5.0, decoding)):
        worker._active[1] = late
        worker._note_playback()
        assert worker.load(0.0).slack == 6.0


def test_the_vocoder_counts_the_admitted_streams_whose_first_audio_is_not_out():
    """Set up or only handed over, they count until their first audio is out; a streamed text waiting for its text
    does not (its first chunk waits for its client)."""
    from cosyvoice_opt.engine.audio_worker import AudioWorker

    def voc(first_sent, feed=None):
        return SimpleNamespace(first_sent=first_sent, sent_s=1.0, job=None, req=SimpleNamespace(feed=feed))

    worker = AudioWorker.__new__(AudioWorker)
    worker._round_s = 0.25
    worker._arrived = [object()]
    worker._active = {0: voc(None), 1: voc(5.0), 2: voc(None, SimpleNamespace(waits_for_text=True))}
    worker._note_playback()
    assert worker.load(0.0) == VocoderLoad(slack=6.0, round_s=0.25, starting=2)


def test_the_first_audio_hold_lasts_while_the_queue_head_cannot_be_admitted():
    """A lone request making its first audio holds decode; a newcomer ends the hold only when it can be admitted
    (else the engine thread would spin through empty steps beside the vocoder)."""
    sched, _ = _scheduler(pages=10)
    lone, newcomer = _request(10), _request(1)
    sched.submit(lone)
    sched._admit(num_slots=4)
    lone.first_audio_busy = True
    sched.submit(newcomer)  # the pool is full: it waits
    with sched._cond:
        assert not sched._hold_ends()
    sched.release(lone)  # its pages come back (as when its audio is done)
    with sched._cond:
        assert sched._hold_ends()
    lone.first_audio_busy = False
    sched.waiting.clear()
    with sched._cond:
        assert sched._hold_ends()


def test_one_step_prefills_a_bounded_number_of_prefix_tokens():
    """A burst of long prompts is admitted over several steps (at least one request per step)."""
    from cosyvoice_opt.engine.llm_runner import PREFILL_TOKENS

    sched, _ = _scheduler(pages=100)
    for _ in range(3):
        sched.submit(_request(0, prefix=PREFILL_TOKENS // 2 + 1))
    assert len(sched._admit(num_slots=8)) == 1 and len(sched._admit(num_slots=8)) == 1


def test_a_request_that_waited_past_the_bound_is_refused_as_busy(monkeypatch):
    FakeClock(monkeypatch)
    sched, _ = _scheduler(pages=10, wait=5.0)
    blocker, late = _request(10), _request(1)
    sched.submit(blocker)
    sched._admit(num_slots=4)
    sched.submit(late)
    sched._expire(late.queued_at + 4.9)  # time as the scheduler reads it
    assert late.out.empty() and list(sched.waiting) == [late]
    sched._expire(late.queued_at + 5.0)
    error = late.out.get_nowait()
    assert isinstance(error, EngineBusy) and error.retry_after >= 1 and "busy" in str(error)
    assert not sched.waiting and sched.stats()["rejected"] == 1


def test_a_newcomer_is_refused_at_once_when_the_queue_is_stuck():
    """A burst on an idle engine is queued; once the head has waited long enough that a newcomer behind the queue
    would not start within the bound (each request ahead waits at least as long as the head has), newcomers are
    refused at once, with a Retry-After within the bound."""
    sched, _ = _scheduler(pages=0, wait=8.0)
    for _ in range(20):
        sched.submit(_request(1))
    assert len(sched.waiting) == 20
    sched.waiting[0].queued_at -= 0.5
    with pytest.raises(EngineBusy) as refused:
        sched.submit(_request(1))
    assert 1.0 <= refused.value.retry_after <= 8.0 and len(sched.waiting) == 20
    assert sched.stats()["rejected"] == 1


def _admit_one_every(sched: Scheduler, clock: FakeClock, seconds: float, count: int) -> None:
    """A backlogged queue that admits one request every `seconds` (each admission waits for the last to end)."""
    running = None
    for _ in range(count):
        sched.submit(_request(1))
        clock.now += seconds
        if running is not None:
            sched.release(running)
        [running] = sched._admit(num_slots=4)
        sched.running.clear()
    sched.release(running)


def test_a_newcomer_is_refused_at_once_when_the_queue_cannot_start_it_in_time(monkeypatch):
    """A queue that starts one request every 0.5 s (measured) cannot start the 11th of a burst within 5 s: it is
    refused at the call, not after waiting 5 s, with a Retry-After of about when the queue has room again; the ones
    that fit are queued."""
    clock = FakeClock(monkeypatch)
    sched, _ = _scheduler(pages=1, wait=5.0)
    _admit_one_every(sched, clock, 0.5, count=12)
    assert sched.admission.pace(clock.now) == pytest.approx(0.5)
    for _ in range(10):  # a burst: the 10th waits behind 9, and starts in about 10 x 0.5 s
        sched.submit(_request(1))
    with pytest.raises(EngineBusy) as refused:  # behind 10: about 5.5 s
        sched.submit(_request(1))
    assert len(sched.waiting) == 10 and sched.stats()["rejected"] == 1
    assert refused.value.retry_after == pytest.approx(1.0)
    for _ in range(20):
        with pytest.raises(EngineBusy) as refused:
            sched.submit(_request(1))
    assert refused.value.retry_after == pytest.approx(1.0)  # the queue is as deep as before: room again as soon
    clock.now += 3.0  # the queue is stuck: its head has waited 3 s, so each one ahead waits at least as long
    with pytest.raises(EngineBusy) as refused:
        sched.submit(_request(1))
    assert refused.value.retry_after == pytest.approx(5.0)  # capped at the bound


def _blocked_queue(clock: FakeClock, pace: float, count: int) -> tuple[Scheduler, Request, list[Request]]:
    """A queue measured to start one request every `pace` s, whose one page a blocker (admitted after `pace` s at
    the head) holds, with `count` requests queued behind it now."""
    sched, _ = _scheduler(pages=1, wait=5.0)
    _admit_one_every(sched, clock, pace, count=12)
    sched.submit(blocker := _request(1))
    clock.now += pace
    assert sched._admit(num_slots=4) == [blocker]
    queued = [_request(1) for _ in range(count)]
    for req in queued:
        sched.submit(req)
    assert list(sched.waiting) == queued and sched.admission.pace(clock.now) == pytest.approx(pace)
    return sched, blocker, queued


def _refusals(queued: list[Request]) -> list[float]:
    """The Retry-After of each refused request, in queue order (those still queued have none)."""
    errors = [req.out.get_nowait() for req in queued if req.cancelled]
    assert all(isinstance(e, EngineBusy) for e in errors)
    return [e.retry_after for e in errors]


def test_queued_requests_the_slowed_pace_cannot_start_in_time_are_refused_at_the_next_step_from_the_back(monkeypatch):
    """Ten requests queued at a pace of 0.5 s (the 10th expected at 5 s, just in time); then the head waits 2 s
    before it starts: the measured pace slows, and at that step the requests it says would not start within the
    bound are refused, the latest first, long before their bound, each with a Retry-After of about when the queue
    has room for it again; the ones that can start stay queued in order."""
    clock = FakeClock(monkeypatch)
    sched, blocker, queued = _blocked_queue(clock, 0.5, count=10)
    clock.now += 2.0
    sched.release(blocker)
    assert sched._admit(num_slots=4) == queued[:1]
    sched.running.clear()
    sched._expire(clock.now)  # the step's expiry, right after its admission
    pace = sched.admission.pace(clock.now)
    assert 0.55 < pace < 0.65  # 2 s at the head among 13 of 0.5 s
    # behind k requests, one starts in (k + 1) x pace: after 2 s of waiting, 4 x pace fits in 3 s, 5 x pace does not
    assert list(sched.waiting) == queued[1:5] and sched.rejected == 5
    retry = _refusals(queued)
    assert len(retry) == 5 and retry == sorted(retry) and min(retry) >= 1.0 and max(retry) <= 5.0
    assert retry[-1] == pytest.approx(2.0 + 9 * pace - 5.0)  # the last would have started that far past the bound


def test_a_stuck_queue_refuses_from_the_back_what_it_cannot_start_in_time(monkeypatch):
    """Nothing starts for 1.5 s after ten requests were queued (the vocoder holds newcomers back): each one ahead
    now waits at least as long as the head has, so only the first two can start within the bound; the other eight
    are refused at that step, with a Retry-After within the bound, not after waiting 5 s."""
    clock = FakeClock(monkeypatch)
    sched, _, queued = _blocked_queue(clock, 0.5, count=10)
    clock.now += 1.5
    assert sched._admit(num_slots=4) == []
    sched._expire(clock.now)
    assert list(sched.waiting) == queued[:2] and sched.rejected == 8
    retry = _refusals(queued)
    assert retry[0] == pytest.approx(1.0) and retry[-1] == pytest.approx(5.0) and retry == sorted(retry)


def test_a_refusal_says_how_many_streams_are_admitted_and_waiting(monkeypatch):
    """The busy message counts what holds the server: the admitted streams (decoding or still playing), not the
    LLM's rows, which are none once every admitted request has its tokens."""
    clock = FakeClock(monkeypatch)
    sched, _, _ = _blocked_queue(clock, 0.5, count=10)
    sched.running.clear()  # the blocker's tokens are all out: it only plays
    with pytest.raises(EngineBusy, match=r"busy \(1 streams admitted, 10 waiting\)"):
        sched.submit(_request(1))


def test_an_engine_thread_waiting_on_a_full_pool_wakes_when_the_last_queued_request_would_start_too_late(monkeypatch):
    """Nothing can start (the pool is full): the engine thread sleeps until the queue's last request would start past
    the bound if nothing starts meanwhile, not until the head's bound, and that step refuses it (only it)."""
    clock = FakeClock(monkeypatch)
    sched, _, queued = _blocked_queue(clock, 0.5, count=8)
    with sched._cond:
        wake = sched._admission_timeout(clock.now)
    # behind 7, with the head's wait growing as its own: t + 8 x t > 5 s (by the pace alone: 5 - 8 x 0.5 = 1 s)
    assert wake == pytest.approx(5.0 / 9)
    clock.now += 0.5
    sched._expire(clock.now)
    assert sched.rejected == 0
    clock.now += wake - 0.5 + 0.01
    sched._expire(clock.now)
    assert list(sched.waiting) == queued[:7] and sched.rejected == 1


def test_no_queued_request_is_refused_while_a_later_one_stays(monkeypatch):
    """FIFO: a request that waited long enough that the pace says it would start late still waits (for the bound,
    or a faster queue) while one behind it, queued later, would start in time."""
    clock = FakeClock(monkeypatch)
    sched, blocker, queued = _blocked_queue(clock, 1.0, count=3)
    clock.now += 3.0
    sched.release(blocker)
    assert sched._admit(num_slots=4) == queued[:1]  # after 3 s at the head
    sched.running.clear()
    pace = sched.admission.pace(clock.now)
    assert 3 * pace < 5.0 < 3.0 + 2 * pace
    sched.submit(late := _request(1))  # behind two: due in 3 x pace, in time
    sched._expire(clock.now)
    # the 3rd, queued 3 s ago, is due in 2 x pace, past its bound, but the newcomer behind it is not
    assert list(sched.waiting) == [*queued[1:], late] and sched.rejected == 0
    clock.now += 2.0
    assert sched._admit(num_slots=4) == []
    sched._expire(clock.now)  # the bound of the first two; the newcomer is the head now: the next admission decides
    assert list(sched.waiting) == [late] and sched.rejected == 2


def test_a_burst_on_an_idle_engine_is_queued_while_each_step_starts_some_of_it(monkeypatch):
    """Forty requests at once on an idle engine that starts four of them every 50 ms step: none is refused, though
    at each step most of the burst is still waiting (the queue's pace is what it measures, not the step)."""
    clock = FakeClock(monkeypatch)
    sched, admitted = _scheduler(pages=4, wait=5.0)
    burst = [_request(1) for _ in range(40)]
    for req in burst:
        sched.submit(req)
    while sched.waiting:
        clock.now += 0.05
        for req in admitted[-4:]:  # the step before's are done: their pages are free
            sched.release(req)
        assert len(sched._admit(num_slots=8)) == 4
        sched.running.clear()
        sched._expire(clock.now)
    assert sched.rejected == 0 and admitted == burst


def test_the_queue_pace_forgets_an_overload_long_gone(monkeypatch):
    """After the backlog of an old overload, a burst of two on a quiet engine is queued: the pace counts only the
    recent admissions, and a newcomer into an empty queue is never refused at once (the next admission decides)."""
    clock = FakeClock(monkeypatch)
    sched, _ = _scheduler(pages=1, wait=2.0)
    _admit_one_every(sched, clock, 3.0, count=5)  # each waited 3 s at the head
    sched.submit(_request(1))  # empty queue: queued, though the pace says 3 s
    with pytest.raises(EngineBusy):  # behind one: about 6 s
        sched.submit(_request(1))
    sched.waiting.clear()
    clock.now += PACE_WINDOW_S + 1.0
    sched.submit(_request(1))
    sched.submit(_request(1))
    assert len(sched.waiting) == 2 and sched.admission.pace(clock.now) == 0.0


def test_admission_gives_way_while_the_vocoder_could_not_come_back_to_a_listener_in_time():
    """The slack a listener needs grows with the vocoder's round time and with the first chunks that go ahead of it,
    and a newcomer is a listener too once its first chunk plays; a burst of newcomers in one step is cut where their
    first audio would leave a listener short."""
    a = Admission(100, 100, 5.0)
    assert not a.holds(VocoderLoad(slack=0.6, round_s=0.1))  # fast rounds: the least slack is the floor
    assert a.holds(VocoderLoad(slack=0.4, round_s=0.1))
    assert a.holds(VocoderLoad(slack=0.9, round_s=0.5))  # the round in progress and the next take 1 s
    assert a.holds(VocoderLoad(slack=1.5, round_s=0.5, starting=FIRST_AUDIO_PER_ROUND * 2))  # two rounds more
    assert not a.holds(VocoderLoad())  # an idle vocoder
    # no one playing, but another newcomer is starting: a first chunk (0.8 s) ends a round, and with rounds of 0.9 s
    # the next one (its second chunk) would come after it ran out; with nothing playing or starting, none is held
    assert a.holds(VocoderLoad(round_s=0.9, starting=1)) and not a.holds(VocoderLoad(round_s=0.7, starting=1))
    assert not a.holds(VocoderLoad(round_s=0.9))
    load = [VocoderLoad(slack=1.0, round_s=0.3)]
    sched = Scheduler(1 << 10, (0,), Admission(1 << 10, 1 << 10, 5.0), vocoder_load=lambda now: load[0])
    for _ in range(40):
        sched.submit(_request(0))
    # 1.0 s of slack covers 0.3 s x (2 + n / 16) rounds while n <= 21
    assert len(sched._admit(num_slots=1 << 10)) == 22
    load[0] = VocoderLoad(slack=1.0, round_s=0.3, starting=22)  # the vocoder has them now
    assert sched._admit(num_slots=1 << 10) == []


@dataclass
class _Stream:
    req: Request
    admitted: float
    sent: float = 0.0  # audio seconds out
    first_sent: float | None = None
    stall: float = 0.0  # the longest its listener waited


class OverloadSim:
    """The scheduler's admission (its own code, on a fake clock) in front of a vocoder too slow for what arrives.

    The vocoder runs rounds back to back while any chunk is due; a round takes `base + per_row * rows` seconds and
    makes, at its end, the first chunk (1 s of audio) of each admitted stream whose first tokens are out (`llm_s`
    after its admission) and the next chunk (2 s) of each listener with less than `due_s` of audio left, until each
    stream has `audio_s`. One newcomer arrives every 1 / `rate` s. Time moves in steps of `dt`: arrivals, then an
    admission step and the queue's bound (as the engine thread's step), then the vocoder."""

    base, per_row, llm_s, due_s, audio_s, dt = 0.05, 0.01, 0.1, 1.5, 8.0, 0.005

    def __init__(self, rate: float, wait: float, clock: FakeClock) -> None:
        self.rate, self.clock = rate, clock
        self.sched = Scheduler(1 << 20, (0,), Admission(1 << 20, 1 << 20, wait), vocoder_load=self.load)
        self.streams: list[_Stream] = []
        self.rounds: list[float] = []
        self.refused_at_once = 0
        self.refused_after: list[float] = []  # seconds each request refused from the queue had waited

    def load(self, now: float) -> VocoderLoad:
        live = [s for s in self.streams if s.sent < self.audio_s]
        slack = min((s.first_sent + s.sent - now for s in live if s.first_sent is not None), default=float("inf"))
        return VocoderLoad(slack, max(self.rounds[-8:], default=0.0), sum(s.first_sent is None for s in live))

    def _due(self, s: _Stream, now: float) -> bool:
        return now - s.admitted >= self.llm_s if s.first_sent is None else s.first_sent + s.sent - now < self.due_s

    def run(self, seconds: float) -> None:
        sched, clock = self.sched, self.clock
        end, arrival, round_end, rows, queued = clock.now + seconds, clock.now, None, [], []
        while clock.now < end:
            now = clock.now
            while arrival <= now:
                try:
                    sched.submit(req := _request(0))
                    queued.append(req)
                except EngineBusy:
                    self.refused_at_once += 1
                arrival += 1 / self.rate
            for req in sched._admit(num_slots=1 << 20):
                sched.running.remove(req)  # the LLM side is not under test
                self.streams.append(_Stream(req, now))
            sched._expire(now)
            for req in [r for r in queued if r.cancelled]:
                assert isinstance(req.out.get_nowait(), EngineBusy)
                self.refused_after.append(now - req.queued_at)
            queued = [r for r in queued if not r.admitted and not r.cancelled]
            if round_end is not None and now >= round_end:
                for s in rows:
                    if s.first_sent is None:
                        s.first_sent, s.sent = now, 1.0
                    else:
                        s.stall = max(s.stall, now - (s.first_sent + s.sent))
                        s.sent = min(self.audio_s, s.sent + 2.0)
                    if s.sent >= self.audio_s:
                        sched.release(s.req)
                round_end, rows = None, []
            if round_end is None:
                rows = [s for s in self.streams if s.sent < self.audio_s and self._due(s, now)]
                if rows:
                    self.rounds.append(self.base + self.per_row * len(rows))
                    round_end = now + self.rounds[-1]
            clock.now += self.dt


@pytest.mark.parametrize("rate", [40.0, 100.0])
def test_a_vocoder_slower_than_real_time_stops_admissions_before_any_listener_runs_dry(monkeypatch, rate):
    """Two and six times what the vocoder can play out arrives (and its rounds grow with its rows): admissions stop
    before any admitted stream's audio runs out, young streams included, the vocoder stays busy, and nearly every
    request that cannot start in time is refused within a second of its arrival: at the call, or from the queue as
    soon as its pace says it would not start in time; none waits for the bound."""
    sim = OverloadSim(rate=rate, wait=5.0, clock=FakeClock(monkeypatch))
    sim.run(60.0)
    assert max(s.stall for s in sim.streams) == 0.0
    assert len(sim.streams) >= 15 * 60  # the vocoder was kept busy (it can play out about 17 streams per second)
    refused = sim.refused_at_once + len(sim.refused_after)
    assert refused > 60 * (rate - 20)
    assert max(sim.refused_after) < 4.0  # none at the bound (5 s)
    assert sum(s > 1.0 for s in sim.refused_after) <= 0.01 * refused


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = Engine(lambda d: random_model("tiny", 0, d),
               EngineConfig(random_size="tiny", device="cpu", max_batch_size=2, max_queue_wait=0.05,
                            voices_dir=str(tmp_path_factory.mktemp("voices"))))
    yield e
    e.close()


def _synth(**kw) -> SynthesisRequest:
    return SynthesisRequest(**{"text": "Hello there.", "prompt_audio": prompt_wav(), "prompt_text": "a prompt",
                               "force_tokens": 30, **kw})


def test_engine_refuses_as_busy_past_the_queue_bound_and_keeps_serving(engine):
    engine._sched.paused = True  # nothing is admitted: the request can only wait
    try:
        it = engine.stream(_synth())
        with pytest.raises(EngineBusy):
            next(it)
    finally:
        engine._sched.paused = False
        engine._sched.poke()
    assert engine.stats()["rejected"] >= 1
    chunks = list(engine.stream(_synth()))
    assert chunks[-1].is_last and sum(len(c.pcm) for c in chunks) > 0


def test_the_vocoder_measures_its_rounds_for_admission(engine):
    """The engine's vocoder times its rounds (what admission reads as its round time; its stats show it): by a
    stream's second chunk, the round that made its first is timed (a round's time is in after its audio is out)."""
    chunks = engine.stream(_synth(force_tokens=150))
    for chunk in chunks:
        if chunk.index == 1:
            assert not chunk.is_last
            assert engine._parts.vocoder.load(time.perf_counter()).round_s > 0
            assert engine.stats()["vocoder_round_s"] > 0
    assert chunk.is_last and chunk.index > 1


def test_an_idle_vocoder_forgets_its_rounds():
    """Round times are those since the vocoder last had nothing to do: a long round of a load long gone does not
    hold the next newcomers back."""
    from collections import deque

    from cosyvoice_opt.engine.audio_worker import AudioWorker

    worker = AudioWorker.__new__(AudioWorker)
    worker._active, worker._arrived = {}, []
    worker._round_times, worker._round_s, worker._earliest_dry, worker._starting = deque([2.0]), 2.0, 0.0, 0
    assert worker._collect() == ([], None)
    assert worker.load(0.0) == VocoderLoad()


def test_max_queue_wait_is_a_live_setting(engine):
    engine.set_max_queue_wait(2.5)
    try:
        assert engine.info["max_queue_wait"] == 2.5 and engine._sched.admission.max_queue_wait == 2.5
        with pytest.raises(ValueError, match="max queue wait"):
            engine.set_max_queue_wait(-1)
    finally:
        engine.set_max_queue_wait(0.05)


def test_a_queue_wait_of_0_means_start_now_or_refuse(engine):
    """0 is no queue, not "refuse everything": on an idle engine a request starts at once (also the start-up warm-up,
    see the next test); one that cannot start at the engine's next admission is refused there as busy."""
    engine.set_max_queue_wait(0)
    try:
        chunks = list(engine.stream(_synth()))
        assert chunks[-1].is_last and sum(len(c.pcm) for c in chunks) > 0
        rejected = engine.stats()["rejected"]
        engine._sched.paused = True  # nothing can start
        try:
            with pytest.raises(EngineBusy):
                next(engine.stream(_synth()))
        finally:
            engine._sched.paused = False
            engine._sched.poke()
        assert engine.stats()["rejected"] == rejected + 1
    finally:
        engine.set_max_queue_wait(0.05)


def test_an_engine_starts_with_a_queue_wait_of_0(tmp_path):
    with Engine(lambda d: random_model("tiny", 0, d),
                EngineConfig(random_size="tiny", device="cpu", max_queue_wait=0, voices_dir=str(tmp_path))) as e:
        assert e.info["max_queue_wait"] == 0 and list(e.stream(_synth()))[-1].is_last


def test_a_queue_wait_of_0_admits_what_fits_and_refuses_the_rest():
    """At a bound of 0 every waiting request has reached it at once: the step admits first, then refuses the rest."""
    sched, admitted = _scheduler(pages=10, wait=0.0)
    fits, blocked = _request(6), _request(6)
    sched.submit(fits)
    sched.submit(blocked)  # not refused at submit: the next admission decides
    assert sched._admit(num_slots=4) == [fits] and admitted == [fits]
    sched._expire(blocked.queued_at)
    assert isinstance(blocked.out.get_nowait(), EngineBusy) and not sched.waiting and sched.rejected == 1


def test_warm_up_is_not_a_completed_request(tmp_path):
    with Engine(lambda d: random_model("tiny", 0, d),
                EngineConfig(random_size="tiny", device="cpu", voices_dir=str(tmp_path))) as e:
        assert e.stats()["completed"] == 0


def test_cuda_errors_that_poison_the_context_are_fatal():
    assert is_fatal(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert is_fatal(RuntimeError("CUDA error: unspecified launch failure"))
    assert not is_fatal(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not is_fatal(ValueError("bad input"))


def test_a_fatal_gpu_error_fails_every_request_and_marks_the_engine_dead(tmp_path, monkeypatch):
    """An illegal-address error in a decode step: the running request fails with a clear error, the engine reports
    itself dead (for /health), and later requests are refused at once instead of hanging."""
    e = Engine(lambda d: random_model("tiny", 0, d),
               EngineConfig(random_size="tiny", device="cpu", voices_dir=str(tmp_path)))
    try:
        def broken(*args, **kwargs):
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(e._parts.runner, "decode", broken)
        with pytest.raises(EngineDead, match="illegal memory access"):
            list(e.stream(_synth()))
        assert e.fatal_error is not None and "illegal memory access" in e.fatal_error
        with pytest.raises(EngineDead):
            e.stream(_synth())
    finally:
        e.close()


def test_a_ready_chunk_waits_for_a_round_only_while_its_listener_has_audio_in_hand():
    """Whole clips and first audio are due at once; a listener's next chunk when its audio runs low or when it has
    waited the hold, whichever comes first."""
    from types import SimpleNamespace

    from cosyvoice_opt.engine.audio_worker import DUE_SLACK_S, MAX_HOLD_S, _RequestAudio

    def voc(stream=True, first_sent=None, sent_s=0.0, ready=0.0):
        v = _RequestAudio.__new__(_RequestAudio)  # only the playback bookkeeping matters here
        v.req = SimpleNamespace(stream=stream, arrival=0.0)
        v.first_sent, v.sent_s, v.job_ready = first_sent, sent_s, ready
        return v

    now = 100.0
    assert voc(stream=False).due(now) == 0.0 and voc(first_sent=None).due(now) == 0.0
    assert voc(first_sent=99.0, sent_s=1.0 + DUE_SLACK_S - 0.1, ready=now).due(now) == 0.0  # running low
    assert voc(first_sent=99.0, sent_s=10.0, ready=now).due(now) == pytest.approx(MAX_HOLD_S)  # plenty in hand
    assert voc(first_sent=99.0, sent_s=10.0, ready=now - MAX_HOLD_S).due(now) == 0.0  # waited the hold


def test_a_fatal_gpu_error_in_a_server_fails_every_stage_and_exits_70():
    """What README and docs/robustness.md promise, in a process of its own (tests/fatal_fault_child.py): with a
    request in each stage (audio being made, LLM decoding, queued), an illegal-address error in decode ends all three
    with `engine_dead`, /health/ready turns 503, and the process exits with code 70 for its supervisor."""
    child = subprocess.run([sys.executable, "-m", "tests.fatal_fault_child"], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    events = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    said = {e["event"]: e for e in events}
    assert said.get("stages") == {"event": "stages", "running": 1, "waiting": 1, "audio": 2}, child.stderr[-3000:]
    answers = {e["stage"]: e["code"] for e in events if e["event"] == "answer"}
    assert answers == {"vocoder": "engine_dead", "running": "engine_dead", "waiting": "engine_dead"}, events
    assert said["ready_before"]["status"] == 200 and said["ready_after"]["status"] == 503
    assert "no_exit" not in said and child.returncode == 70, (child.returncode, child.stderr[-3000:])


def test_a_newcomer_to_an_idle_vocoder_is_never_held_however_slow_its_last_rounds():
    """Nothing playing and nothing starting: the newcomer's first chunk has the vocoder to itself, so slow recent
    rounds (a CPU's, or those of requests that were cancelled) do not hold it back; a second one in the same step
    is weighed against them."""
    admission = Admission(pages=100, streams=10, max_queue_wait=5.0)
    idle_after_slow_rounds = VocoderLoad(slack=float("inf"), round_s=2.0, starting=0)
    assert not admission.holds(idle_after_slow_rounds)
    assert admission.holds(idle_after_slow_rounds, admitted_now=1)
