"""Requests and continuous batching.

One engine thread owns the LLM: between two decode steps it retires finished or cancelled requests (their KV slot
is free for the next step), admits waiting ones in FIFO order while `Admission` says everything they need is free
and the vocoder has time for them (all newcomers of a step prefilled together, up to `PREFILL_TOKENS` of prefix per
step, so a burst of long prompts never stalls decoding for long), refuses the waiting ones that cannot start in
time, then queues one batched decode step for everyone and hands each request its tokens of the step queued before
(decode runs one step ahead of the host, see `Scheduler.step`). Audio is made by the vocoder worker
(`audio_worker`), which reads a request's tokens as they grow; the two threads meet only through the request
objects below and one condition variable each, so nothing sleeps or polls.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from cosyvoice_opt.engine.admission import ROOM_GROW_TOKENS, ROOM_WAIT_S, Admission, VocoderLoad
from cosyvoice_opt.engine.bistream import BistreamFeed
from cosyvoice_opt.engine.host import HostCopy
from cosyvoice_opt.engine.llm_runner import PREFILL_TOKENS, LLMRunner
from cosyvoice_opt.errors import CosyVoiceError, EngineBusy, InputError
from cosyvoice_opt.limits import MAX_QUEUE_WAIT_S
from cosyvoice_opt.models.bistream import embed_segments, input_length
from cosyvoice_opt.models.llm import SpeechLLM
from cosyvoice_opt.types import AudioChunk, ChunkTimings

log = logging.getLogger(__name__)

HOLD_S = 0.2  # the longest decode waits for first audio in one go (see `Scheduler._hold`)
SLACK_RECHECK_S = 0.02  # admissions held back for a playing stream's sake are looked at again this often

_ids = itertools.count()


@dataclass
class TextPiece:
    """One sentence group of the target text: the ids of its LLM prefix and its length limits. `tokens` grows as the
    LLM decodes (engine thread appends, vocoder thread reads; list append/len are atomic in CPython).

    The ids stay on the CPU (pinned on CUDA): the engine thread embeds them right before the prefill, so the
    caller's thread that prepared the request queues no LLM work behind the decode loop.
    """

    text_ids: torch.Tensor  # [T] long: prompt/instruct text + target text (what `SpeechLLM.prefix` embeds)
    prompt_speech: torch.Tensor | None  # [P] prompt speech ids (zero-shot only)
    min_len: int
    max_len: int
    tokens: list[int] = field(default_factory=list)
    done: bool = False  # the LLM has finished this piece

    @property
    def prefix_len(self) -> int:
        """Positions of the prefix: sos, text, task_id, prompt speech."""
        return self.text_ids.numel() + 2 + (0 if self.prompt_speech is None else self.prompt_speech.numel())

    def prefix(self, llm: SpeechLLM, device: torch.device) -> torch.Tensor:
        """The prefix embeddings `[1, prefix_len, H]` on `device` (no host sync: the ids are pinned on CUDA)."""
        speech = None if self.prompt_speech is None else self.prompt_speech.to(device, non_blocking=True)
        return llm.prefix(self.text_ids.to(device, non_blocking=True), None, speech)


@dataclass
class FlowPrompt:
    """What flow needs besides the tokens: prompt speech tokens `[1,P]`, prompt mel `[1,2P,80]`, x-vector `[1,192]`,
    on the CPU (pinned on CUDA); `Flow.new_stream` copies them to the device once per text piece. A new voice's mel
    and x-vector are futures while worker threads make them: the LLM needs neither, so its request starts before."""

    tokens: torch.Tensor
    feat: torch.Tensor | Future[torch.Tensor]
    embedding: torch.Tensor | Future[torch.Tensor]

    def _futures(self) -> list[Future]:
        return [t for t in (self.feat, self.embedding) if isinstance(t, Future)]

    def ready(self) -> bool:
        return all(f.done() for f in self._futures())

    def on_ready(self, fn: Callable[[], None]) -> None:
        """Call `fn()` as each part still in the making is done (in the thread that made it)."""
        for f in self._futures():
            f.add_done_callback(lambda _: fn())

    def resolve(self) -> None:
        """Take the finished parts in place of their futures (raises a worker's error)."""
        if isinstance(self.feat, Future):
            self.feat = self.feat.result()
        if isinstance(self.embedding, Future):
            self.embedding = self.embedding.result()


class Request:
    """A request's whole life: LLM progress (engine thread), audio progress (vocoder thread), output queue."""

    def __init__(
        self,
        pieces: list[TextPiece],
        prompt: FlowPrompt,
        *,
        stream: bool,
        speed: float,
        seed: int,
        force_tokens: int | None,
        arrival: float,
        frontend_s: float,
        warnings: tuple[str, ...] = (),
        pages: int = 0,
        feed: BistreamFeed | None = None,
    ) -> None:
        self.id = next(_ids)
        self.feed = feed  # the text streams in (one piece, decoded in cycles; see engine/bistream.py)
        self.pieces = pieces
        self.prompt = prompt
        self.stream = stream
        self.speed = speed
        self.seed = seed
        self.force_tokens = force_tokens
        self.arrival = arrival
        self.timings = ChunkTimings(frontend=frontend_s)  # stage totals so far; each chunk gets a copy
        self.warnings = warnings  # delivered with the first chunk
        self.out: queue.SimpleQueue[AudioChunk | BaseException] = queue.SimpleQueue()
        self.cancelled = False
        self.finished = False  # is_last chunk or an error was delivered
        self.slot: int | None = None  # KV slot while the LLM runs it
        self.kv_len = 0  # positions filled in that slot
        self.needs_prefill = False  # moved on to its next text piece
        self.piece_index = 0  # the piece the LLM is decoding
        self.batch_size = 1  # LLM batch when the last token was decoded
        self.chunks_sent = 0
        self.first_audio_busy = False  # the vocoder thread is making its first audio (set and cleared there)
        self.pages = pages  # flow pages reserved from admission to the last audio (see `Admission`)
        self.token_room: int | None = None  # streamed text: speech tokens those pages cover (they grow with it)
        self.room_wait_since: float | None = None  # when its row began waiting for pages to grow into
        self.queued_at = 0.0  # when it joined the waiting queue
        self.admitted = False  # holds its reservation
        self.internal = False  # the engine's own warm-up: not counted as a user's request

    @property
    def piece(self) -> TextPiece:
        return self.pieces[self.piece_index]

    @property
    def piece_seed(self) -> int:
        """Each piece samples from its own stream, derived from the request seed."""
        return self.seed + 1_000_003 * self.piece_index

    @property
    def total_tokens(self) -> int:
        return sum(len(p.tokens) for p in self.pieces)

    def cancel(self) -> None:
        """Called from the consumer's thread; the engine frees the slot at its next step."""
        self.cancelled = True

    def send(self, pcm, sample_rate: int, is_last: bool) -> None:
        timings = dataclasses.replace(self.timings, since_arrival=time.perf_counter() - self.arrival,
                                      batch_size=self.batch_size)
        chunk = AudioChunk(pcm=pcm, sample_rate=sample_rate, index=self.chunks_sent, is_last=is_last,
                           tokens=self.total_tokens, timings=timings,
                           warnings=() if self.chunks_sent else self.warnings)
        self.chunks_sent += 1
        self.finished = is_last
        self.out.put(chunk)

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self.finished = True
            self.out.put(error)


@dataclass
class _Launch:
    """A queued LLM step: who its rows are (request and the piece it was decoding), and its tokens on their way to
    the host (the prefilled requests' first tokens, then one per row)."""

    prefilled: list[tuple[Request, int]]
    rows: list[tuple[Request, int]]
    tokens: HostCopy


class Scheduler:
    """Waiting queue and the running batch. Running request `i` always sits in KV slot `i` (see `LLMRunner`).

    `submit`, `poke`, `set_max_batch_size` and `stats` may be called from any thread; `step` only from the
    engine thread, which `wait`s here when there is nothing to do.
    """

    def __init__(self, max_batch_size: int, stop_token_ids: tuple[int, ...], admission: Admission | None = None,
                 on_admit: Callable[[Request], None] = lambda req: None,
                 vocoder_load: Callable[[float], VocoderLoad] = lambda now: VocoderLoad(),
                 pages_for: Callable[[Request, int], int] = lambda req, tokens: 0) -> None:
        """`admission` (default: no limit but the batch size) decides who may start; `on_admit(req)` hands an admitted
        request to the vocoder; `vocoder_load(now)` is the vocoder's state that admission weighs (its playing
        streams' least audio left, its round time, its starting streams); `pages_for(req, tokens)` the flow pages
        that `tokens` speech tokens of `req` need, prompt included (a streamed-text reservation grows by it)."""
        self._cond = threading.Condition()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.max_batch_size = max_batch_size
        self.admission = admission or Admission(1 << 30, 1 << 30, MAX_QUEUE_WAIT_S)
        self._on_admit = on_admit
        self._vocoder_load = vocoder_load
        self._pages_for = pages_for
        self.paused = False  # no admissions (precision switch drains)
        self.completed = 0
        self.failed = 0
        self.rejected = 0  # refused as busy
        self.steps = self.step_rows = 0  # steps that queued LLM work, and the decode rows in them, since start
        self.busy_s = 0.0  # seconds of those steps (each waits for the step before it: GPU time included)
        self._pokes = 0
        self._stop_ids = frozenset(stop_token_ids)
        self._inflight: _Launch | None = None  # the step queued on the GPU whose tokens are not read yet
        self._head_changed = 0.0  # when the queue's head last left it (admitted, refused or dropped)

    # ---- any thread ----------------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Queue `req`, or raise `EngineBusy` at once when the queue's pace says it would not start within the
        queue's bound (`Admission.expected_start`)."""
        with self._cond:
            now = time.perf_counter()
            expected = self._expected_start(now, len(self.waiting))
            if self.admission.late(expected):
                self.rejected += 1
                raise self._busy(expected)
            req.queued_at = now
            self.waiting.append(req)
            self._cond.notify_all()

    def _head_for(self, now: float) -> float:
        """Seconds the queue's head has been at the head (0: empty queue). Called with the lock held."""
        return now - max(self._head_changed, self.waiting[0].queued_at) if self.waiting else 0.0

    def _expected_start(self, now: float, ahead: int) -> float:
        """When a request behind `ahead` waiting ones would start, in seconds from `now`. Called with the lock held."""
        return self.admission.expected_start(ahead, self._head_for(now), now)

    def _busy(self, expected_start: float, waited: float = 0.0) -> EngineBusy:
        retry = self.admission.retry_after(expected_start, waited)
        return EngineBusy(f"the server is busy ({self.admission.streams_held} streams admitted, "
                          f"{len(self.waiting)} waiting); try again in {retry:.0f} s", retry_after=retry)

    def release(self, req: Request) -> None:
        """`req` made its last audio, failed or was cancelled: its reservation is free for the queue."""
        with self._cond:
            if req.admitted:
                req.admitted = False
                self.admission.give_back(req.pages)
                self._cond.notify_all()

    def resize_admission(self, pages: int, streams: int) -> None:
        """The flow page pool now has `pages` pages and the vocoder room for `streams` streams."""
        with self._cond:
            self.admission.pages, self.admission.streams = pages, streams
            self._cond.notify_all()

    def set_max_queue_wait(self, seconds: float) -> None:
        with self._cond:
            self.admission.max_queue_wait = seconds
            self._cond.notify_all()

    def poke(self) -> None:
        """Wake the engine thread (a cancel, a setting change, a stop)."""
        with self._cond:
            self._pokes += 1
            self._cond.notify_all()

    def set_max_batch_size(self, n: int) -> None:
        with self._cond:
            self.max_batch_size = n
            self._cond.notify_all()

    def count_done(self, ok: bool) -> None:
        with self._cond:
            if ok:
                self.completed += 1
            else:
                self.failed += 1

    def stats(self) -> dict:
        with self._cond:
            a = self.admission
            return {"running": len(self.running), "waiting": len(self.waiting), "batch_size": len(self.running),
                    "completed": self.completed, "failed": self.failed, "rejected": self.rejected,
                    "streams": a.streams_held, "max_streams": a.streams, "pages_reserved": a.pages_held,
                    "queue_pace_s": a.pace(time.perf_counter())}

    def idle(self) -> bool:
        """Lock-free (one atomic read), so it can be a predicate under another thread's condition."""
        return not self.running

    # ---- engine thread -------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until there is a request to run, one to admit or to expire, or someone poked."""
        with self._cond:
            while not self._pokes and not self._has_work():
                timeouts = [self._admission_timeout(time.perf_counter()), self._text_timeout(), self._room_timeout()]
                timeout = min((t for t in timeouts if t is not None), default=None)
                if timeout == 0.0:
                    break
                self._cond.wait(timeout)
            self._pokes = 0

    def _has_work(self) -> bool:
        """A step would do something for the running requests: a request parked for streamed text has none until
        its text arrives, ends or is overdue."""
        now = time.monotonic()
        return self._inflight is not None or any(r.feed is None or (r.feed.live and self._room(r)) or r.feed.ready(now)
                                                 for r in self.running)

    def _room(self, req: Request) -> bool:
        """Whether a streamed-text row may decode now: its reservation covers the tokens this step and the one in
        flight can make (two each: a cycle's input and its row), or grows (`Admission.grow`) to cover more. A row
        that may not starts (or goes on) waiting for pages (`room_wait_since`)."""
        piece = req.piece
        if req.token_room is None or len(piece.tokens) + 4 <= req.token_room or req.token_room >= piece.max_len:
            return True
        room = min(piece.max_len, req.token_room + ROOM_GROW_TOKENS)
        pages = self._pages_for(req, room)
        with self._cond:
            if self.admission.grow(pages - req.pages):
                req.pages, req.token_room, req.room_wait_since = pages, room, None
                return True
        if req.room_wait_since is None:
            req.room_wait_since = time.monotonic()
        return False

    def _room_timeout(self) -> float | None:
        """Seconds until the first row waiting for pages has waited `ROOM_WAIT_S` (None: none is waiting)."""
        since = [r.room_wait_since for r in self.running if r.room_wait_since is not None]
        return max(0.0, min(since) + ROOM_WAIT_S - time.monotonic()) if since else None

    def _fail_roomless(self) -> None:
        """Streamed-text requests whose row has waited `ROOM_WAIT_S` for pages fail (every admitted request may be
        waiting on the others: someone must give pages back)."""
        now = time.monotonic()
        for req in self.running:
            if req.room_wait_since is not None and now - req.room_wait_since >= ROOM_WAIT_S and not req.cancelled:
                self.count_done(False)
                req.cancel()
                req.fail(CosyVoiceError(f"the server has no flow memory left to go on with this streamed text after "
                                        f"{len(req.piece.tokens)} speech tokens (it waited {ROOM_WAIT_S:g} s for "
                                        "other requests to end); send shorter texts per request, or retry later"))

    def _text_timeout(self) -> float | None:
        """Seconds until the first parked request's text counts as stopped (None: none is waiting for text)."""
        deadlines = [d for r in self.running if r.feed is not None and (d := r.feed.deadline()) is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _admission_timeout(self, now: float) -> float | None:
        """0 when the queue's head can be admitted, dropped or expired now; else how long until that may change by
        itself, or the last waiting request would start too late (None: only an event can change it). Called with
        the lock held."""
        if not self.waiting:
            return None
        head, last = self.waiting[0], self.waiting[-1]
        expires = min(head.queued_at + self.admission.max_queue_wait - now,
                      self.admission.late_in(len(self.waiting) - 1, self._head_for(now), now - last.queued_at, now))
        if head.cancelled or expires <= 0:
            return 0.0
        if self.paused or len(self.running) >= self.max_batch_size or not self.admission.fits(head.pages):
            return expires
        if self.admission.holds(self._vocoder_load(now)):
            return min(expires, SLACK_RECHECK_S)
        return 0.0

    def drop_waiting(self) -> list[Request]:
        with self._cond:
            reqs = list(self.waiting)
            self.waiting.clear()
            return reqs

    def _expire(self, now: float) -> None:
        """Refuse, as busy, the waiting requests that cannot start within the queue's bound: those that have reached
        it (the oldest, at the front), then, from the back, each one the queue's pace now says would not start in
        time (`Admission.late`: the pace may have slowed since it was queued), up to the first that would, so that
        no one is refused while a later one stays. The head is refused only at the bound (the next admission
        decides)."""
        with self._cond:
            bound = self.admission.max_queue_wait
            while self.waiting and now - self.waiting[0].queued_at >= bound:
                req = self.waiting.popleft()
                self._head_changed = now
                self._refuse(req, self._busy(self._expected_start(now, len(self.waiting))))
            while len(self.waiting) > 1:
                req = self.waiting[-1]
                expected, waited = self._expected_start(now, len(self.waiting) - 1), now - req.queued_at
                if not self.admission.late(expected, waited):
                    break
                self.waiting.pop()
                self._refuse(req, self._busy(expected, waited))

    def _refuse(self, req: Request, busy: EngineBusy) -> None:
        """`req`, out of the queue, is refused as busy (unless it was cancelled). Called with the lock held."""
        if not req.cancelled:
            self.rejected += 1
            req.cancel()  # one requeued after running out of memory is the vocoder's too: it lets go of it
            req.fail(busy)

    def _admit(self, num_slots: int) -> list[Request]:
        """Waiting requests, in order, into the free slots at the end of the batch while each one's reservation fits
        and the step's prefill stays within `PREFILL_TOKENS` (one request at least), unless the playing streams hold
        them back (`Admission.holds`, counting the newcomers this step has admitted); cancelled ones are dropped
        here. Each admission's time at the head of the queue is the queue's pace (`Admission.started`)."""
        admitted, fresh, tokens = [], [], 0
        with self._cond:
            limit = min(self.max_batch_size, num_slots)
            now = time.perf_counter()
            load = self._vocoder_load(now)
            while self.waiting and not self.paused and len(self.running) < limit:
                req = self.waiting[0]
                if req.cancelled:
                    self.waiting.popleft()
                    self._head_changed = now
                    continue
                tokens += req.piece.prefix_len
                if self.admission.holds(load, len(fresh)) or not self.admission.fits(req.pages) \
                        or (admitted and tokens > PREFILL_TOKENS):
                    break
                self.admission.started(now, self._head_for(now))
                self.waiting.popleft()
                self._head_changed = now
                if not req.admitted:  # requeued after running out of memory: it still holds its reservation
                    self.admission.take(req.pages)
                    req.admitted = True
                    fresh.append(req)
                req.slot = len(self.running)
                self.running.append(req)
                admitted.append(req)
        for req in fresh:  # outside the lock: the vocoder's lock is taken before this one when a request ends
            self._on_admit(req)
        return admitted

    def _retire(self, req: Request, runner: LLMRunner) -> None:
        """Free `req`'s slot by moving the last running request into it (slots stay `0..B-1`)."""
        with self._cond:
            last = self.running.pop()
            if last is not req:
                runner.move(last.slot, req.slot, last.kv_len)
                last.slot = req.slot
                self.running[req.slot] = last
            req.slot = None

    def step(self, runner: LLMRunner) -> list[Request]:
        """One iteration: retire cancelled, admit, queue prefill + one batched decode step on the GPU, then hand out
        the tokens of the step queued by the previous call. Returns the requests that got tokens (the vocoder may have
        work for them) and those that failed (after running out of memory, see `_shed`, or a streamed text's refusal).

        Decode is pipelined one step deep: a step's inputs (last token, position, window) are on the device, so step
        N+1 is queued before step N's tokens are read. The GPU then never waits for the host's share of a step (graph
        launch, this bookkeeping), which was a third of a step at one stream. The price: a request that ends at step N
        has one more row decoded in step N+1, whose token is dropped (`_deliver`); its slot has room for it (the
        engine caps each piece one position below the cache)."""
        t0 = time.perf_counter()
        self._fail_roomless()
        for req in [r for r in self.running if r.cancelled]:
            self._retire(req, runner)
        prefill = [r for r in self.running if r.needs_prefill] + self._admit(runner.num_slots)
        self._expire(t0)  # after admitting: a request that can start now does, even at its bound (0: no queue)
        prefill, extend, failed = self._poll_text(prefill, runner.max_seq)
        previous, self._inflight = self._inflight, None
        # a text block that `_poll_text` took has started its row's cycle: it is fed now, hold or not
        if not prefill and not extend and self._lone_request_making_first_audio():
            touched = self._deliver(previous, runner, t0)
            if self._lone_request_making_first_audio():  # still running after its last tokens were delivered
                self._hold()
            return touched + failed
        if self.running:
            try:
                self._inflight = self._launch(runner, prefill, extend)
            except torch.cuda.OutOfMemoryError:
                return self._deliver(previous, runner, t0) + self._shed(runner, prefill) + failed
        touched = self._deliver(previous, runner, t0) + failed
        if self._inflight is not None:
            self.steps += 1
            self.step_rows += len(self._inflight.rows)
            self.busy_s += time.perf_counter() - t0
        if not self.running and self._inflight is not None:  # every row of it belongs to a request that has ended
            self._inflight.tokens.wait()
            self._inflight = None
        return touched

    def _lone_request_making_first_audio(self) -> bool:
        return len(self.running) == 1 and self.running[0].first_audio_busy and not self.running[0].cancelled

    def _hold(self) -> None:
        """The one running request has the tokens of its first chunk, and the vocoder is making that audio now: decode
        waits until it is out (or a newcomer can be admitted, a cancel or setting change arrives, or `HOLD_S` passes).
        A newcomer that cannot be admitted yet does not end the hold: the step would do nothing for it, and the
        engine thread would spin, taking the GIL from the vocoder thread that is making this very audio.

        Why: at low load both engine threads are bound by launching kernels, and their launches wait for each other
        (measured on the H200: the first chunk's flow encoder took 48 ms next to the decode loop, 7.5 ms alone). Nobody
        is listening yet, and the next chunk's tokens are not needed before the first chunk has played (1 s or more).
        Measured at one stream: first packet p50 146 -> 122-126 ms, RTF 0.053 -> 0.057-0.058. The same hold with
        every one of several running requests making its first audio made 16 streams' first packet 355 -> 975 ms
        (cause not established), so it is kept to a lone request."""
        with self._cond:
            pokes = self._pokes
            self._cond.wait_for(lambda: self._pokes != pokes or self._hold_ends(), timeout=HOLD_S)

    def _hold_ends(self) -> bool:
        """The lone request's first audio is out, it was cancelled, or the queue's head can be admitted (or dropped)
        now. Called with the lock held."""
        return not self._lone_request_making_first_audio() or self._admission_timeout(time.perf_counter()) == 0.0

    def _poll_text(self, prefill: list[Request], max_seq: int) -> tuple[list[Request], list[Request], list[Request]]:
        """Streamed-text requests: admitted ones prefill only once their text allows; each parked one takes its
        arrived text, and one whose decode cycle starts feeds the cycle's input (a prefill into its empty slot, else
        an extend). Returns (prefill, extend, failed): the failed ones' audio stage must hear of it."""
        prefill, extend, failed = [r for r in prefill if r.feed is None], [], []
        now = time.monotonic()
        for req in self.running:
            if req.feed is None or req.cancelled:
                continue
            segments = req.feed.poll(now)
            if req.feed.no_text:
                self.count_done(False)
                req.cancel()
                req.fail(InputError("the streamed text has nothing to speak: it ended, or stopped arriving, before a "
                                    "word came; send at least one word"))
                failed.append(req)
                continue
            if segments is None:
                continue
            if req.kv_len + input_length(segments) + req.feed.plan.n_speech + 2 > max_seq:
                self.count_done(False)
                req.cancel()
                req.fail(InputError(f"the streamed text is too long for one request ({max_seq} positions with the "
                                    "prompt and the speech); start a new request for more"))
                failed.append(req)
                continue
            (extend if req.kv_len else prefill).append(req)
        return prefill, extend, failed

    @staticmethod
    def _lm_input(req: Request, runner: LLMRunner) -> torch.Tensor:
        if req.feed is not None:
            return embed_segments(runner.llm, req.feed.plan.input(), runner.device)
        return req.piece.prefix(runner.llm, runner.device)

    def _launch(self, runner: LLMRunner, prefill: list[Request], extend: list[Request]) -> _Launch | None:
        """Queue the newcomers' prefill, the streamed-text requests' next inputs and one decode step for every
        running request that is not parked; nothing waits for the GPU. None when there was nothing to queue."""
        firsts = []
        with torch.inference_mode():
            lm_inputs = [self._lm_input(r, runner) for r in prefill + extend]
        if prefill:
            texts = [r.feed is not None and r.feed.plan.phase == "text" for r in prefill]
            firsts.append(runner.prefill_many(
                [r.slot for r in prefill], lm_inputs[:len(prefill)], [r.piece_seed for r in prefill],
                [0 if r.feed else r.piece.min_len for r in prefill],
                [r.force_tokens is not None or text for r, text in zip(prefill, texts, strict=True)]))
            for req in prefill:
                req.kv_len = 0
                req.needs_prefill = False
        if extend:
            plans = [r.feed.plan for r in extend]
            firsts.append(runner.extend_many([r.slot for r in extend], lm_inputs[len(prefill):],
                                             [r.kv_len for r in extend], [len(p.out) for p in plans],
                                             [p.out for p in plans],
                                             [p.phase == "text" or r.force_tokens is not None
                                              for r, p in zip(extend, plans, strict=True)]))
        for req, x in zip(prefill + extend, lm_inputs, strict=True):
            req.kv_len += x.shape[1]
            if req.feed is not None:
                req.feed.start_cycle(req.kv_len, runner.max_seq)
        live = [r.feed is None or (r.feed.live and self._room(r)) for r in self.running]
        rows = []
        if any(live):
            n, kv_needed, parked = len(self.running), max(r.kv_len for r in self.running) + 1, [not x for x in live]
            firsts.append(runner.decode(n, kv_needed, parked) if any(parked) else runner.decode(n, kv_needed))
            for req, is_live in zip(self.running, live, strict=True):
                if is_live:
                    req.kv_len += 1
                    if req.feed is not None:
                        req.feed.launched()
            rows = [(r, r.piece_index) if x else (None, -1) for r, x in zip(self.running, live, strict=True)]
        if not firsts:
            return None
        return _Launch([(r, r.piece_index) for r in prefill + extend], rows, HostCopy(torch.cat(firsts)))

    def _deliver(self, launch: _Launch | None, runner: LLMRunner, t0: float) -> list[Request]:
        """Wait for `launch`'s tokens (the one sync of a step) and append them to their pieces. Rows of a request that
        has since ended, been cancelled or moved on to its next piece are dropped. Nothing to do without a launch."""
        if launch is None:
            return []
        host = launch.tokens.wait().tolist()
        elapsed = time.perf_counter() - t0
        n = len(launch.prefilled)
        firsts = {req.id: tok for (req, _), tok in zip(launch.prefilled, host[:n], strict=True)}
        # a streamed-text request whose input alone made its cycle's token (a forced fill) has no row
        alone = [(r, i, [firsts[r.id]]) for r, i in launch.prefilled if all(r is not q for q, _ in launch.rows)]
        rows = [(r, i, [tok] if r is None or r.id not in firsts else [firsts[r.id], tok])
                for (r, i), tok in zip(launch.rows, host[n:], strict=True)]
        touched = []
        for req, piece_index, tokens in rows + alone:
            if req is None or req.slot is None or req.cancelled or req.piece_index != piece_index:
                continue  # parked, ended, cancelled or on its next piece
            req.batch_size = max(1, len(launch.rows))
            req.timings.llm += elapsed
            self._take(req, tokens)
            touched.append(req)
        for req in touched:
            if req.piece.done:
                if req.piece_index + 1 < len(req.pieces):
                    req.piece_index += 1
                    req.needs_prefill = True
                else:
                    self._retire(req, runner)
        return touched

    def _shed(self, runner: LLMRunner, prefill: list[Request]) -> list[Request]:
        """Out of memory in a step: halve the batch. The newest half leaves it: requests with no token yet go back
        to the front of the queue, the others fail with a clear message (their audio has started; it cannot be
        redone). `max_batch_size` drops to what stays, so they are not readmitted into the same failure.
        Returns the failed requests (the vocoder must notice them)."""
        for req in prefill:  # their first token was lost with the step: prefill again
            req.needs_prefill = True
        by_age = sorted(self.running, key=lambda r: r.id)
        keep = len(by_age) // 2
        requeue, failed = [], []
        for req in by_age[keep:]:
            self._retire(req, runner)
            (requeue if req.total_tokens == 0 and keep else failed).append(req)
        for req in requeue:
            req.kv_len, req.needs_prefill, req.queued_at = 0, False, time.perf_counter()
        with self._cond:
            self.waiting.extendleft(reversed(requeue))
            self.max_batch_size = max(1, keep)
        log.warning("out of GPU memory at batch size %d: max batch size lowered to %d, %d request(s) requeued, %d "
                    "failed", len(by_age), max(1, keep), len(requeue), len(failed))
        for req in failed:
            self.count_done(False)
            req.cancel()
            req.fail(CosyVoiceError(f"out of GPU memory with {len(by_age)} requests in the batch; this request was "
                                    "stopped, please retry it"))
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
        return failed

    def _take(self, req: Request, tokens: list[int]) -> None:
        """Append this step's tokens to the current piece, ending it at a stop id or its length limit."""
        piece = req.piece
        if req.feed is not None:
            piece.done = req.feed.take(tokens, piece.tokens.append)
            return
        limit = piece.max_len if req.force_tokens is None else req.force_tokens
        for tok in tokens:
            if piece.done:
                return
            if tok in self._stop_ids:
                piece.done = True
                return
            piece.tokens.append(tok)
            piece.done = len(piece.tokens) >= limit
