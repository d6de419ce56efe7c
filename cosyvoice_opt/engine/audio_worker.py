"""Tokens -> audio on a worker thread, so LLM decode steps keep going while flow and HiFT run.

Per request and text piece: a `HopSchedule` (upstream's chunking: first hop padded to the 25-token grid incl.
the prompt, hops doubling to 100, 3 look-ahead tokens), an incremental `FlowStreamState` (each chunk computes
only its new frames) and the family's vocoder state (`engine/family.py`: CosyVoice2's `HiftStreamState`, mel/source
caches and cross-fade; CosyVoice3's `CausalHiFTStream`). The family also says which LLM tokens reach the flow.
The flow chunks of every request
ready in a round run as batches (rows padded and masked): through the `FlowRunner` (paged estimator history, one
CUDA graph per batch) for streams that got a page slot, else through the eager `Flow.stream_chunks`; their HiFT
calls run as one batch per input shape. Each request draws HiFT's random source from its own generator (seeded by
the request seed), so its audio does not depend on what else is in the batch; the HiFT batches of streaming chunks
run from CUDA graphs (the family's `VocoderGraphs`, with the engine's `cuda_graphs`). When a round needs several
flow batches, each batch's audio goes out before the next batch runs, most urgent first (`by_urgency`): streams still
waiting for their first audio, and listeners about to run out, make a small batch of their own ahead of the listeners
with audio in hand, which follow, those closest to running out first. A round of few chunks is one batch (a call is
launch-bound).

A stream leaves the paged path when a low-precision chunk is not finite (it continues eagerly in fp32), or when
the pool has no pages for its next chunk, which admission (`engine/admission.py`) rules out by reserving every
stream's pages up front. Either way its eager state is rebuilt from the tokens it has consumed, which equals what
its chunks had computed.

Whole clips (no streaming) follow upstream's non-streaming `tts`: per piece, the flow with full attention over the
prompt and every token (`Flow.inference(streaming=False)`), the speed change, and HiFT over the whole mel. A streamed
request's final chunk stays block-causal (upstream runs it with full attention over everything): every chunk then
continues the ones before it, which the paged flow needs, and the two differ only in that last chunk's frames.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from cosyvoice_opt.config import ModelConfig
from cosyvoice_opt.engine.admission import VocoderLoad
from cosyvoice_opt.engine.counters import VocoderCounters
from cosyvoice_opt.engine.family import CosyVoice2Family, ModelFamily
from cosyvoice_opt.engine.faults import is_fatal
from cosyvoice_opt.engine.flow_runner import FlowRunner, PagedStream, PrefixRide, flow_prompt_key
from cosyvoice_opt.engine.host import to_host
from cosyvoice_opt.engine.precision import FallbackCounter, PrecisionPolicy
from cosyvoice_opt.engine.scheduler import Request
from cosyvoice_opt.engine.streaming import HopSchedule, StreamConfig, change_speed
from cosyvoice_opt.errors import CosyVoiceError
from cosyvoice_opt.models.flow import FlowBase, FlowStreamState
from cosyvoice_opt.models.hift import HiFTBase

log = logging.getLogger(__name__)

DUE_SLACK_S = 1.5  # a listener's next chunk runs once it has less audio left than this (a round takes < 0.5 s) ...
MAX_HOLD_S = 0.25  # ... or once it has been ready this long: audio is still made many times faster than it plays
# A paged flow call of a few rows costs about what one row costs (launch-bound: on the H200 under open-loop load, 39 ms
# at 2.2 rows on average, encoder included, and 81 ms at 5.7; docs/benchmarks.md, run E), so a round of up to this
# many chunks is one call.
ONE_BATCH_ROWS = 16
URGENT_SLACK_S = 1.0  # a listener with less audio than this left runs in the next round, ahead of the others
# While streams play, a round takes at most this many whole clips (the longest waiting first): a whole clip is one
# flow call over its whole piece, run alone, so a round of many grows past a first chunk's audio, and a playing stream
# waits for the whole round (and admission, reading the rounds, holds every newcomer until they drain). The others
# go in the rounds after, each of which runs at once (a whole clip is always due).
WHOLE_CLIPS_PER_ROUND = 1
ROUND_HISTORY = 8  # the vocoder's round time, as admission reads it, is the longest of its last this many rounds
# (since it last had nothing to do)


def to_pcm16(waves: list[Tensor]) -> tuple[list[bool], list[np.ndarray]]:
    """Float audio in [-1, 1] -> (finite?, int16 samples) per wave, with one device-to-host copy for all of them (no
    per-chunk normalisation: chunks must not change loudness)."""
    flags = [torch.isfinite(w).all().to(torch.int16).reshape(1) for w in waves]
    pcm = [(w.float().clamp(-1, 1) * 32767).round().to(torch.int16).reshape(-1) for w in waves]
    host = to_host(torch.cat(flags + pcm)).numpy()
    split = np.cumsum([len(waves)] + [p.numel() for p in pcm])[:-1]
    finite, *samples = np.split(host, split)
    return finite.astype(bool).tolist(), samples


@dataclass
class _Job:
    """One flow + HiFT chunk of one request."""

    voc: _RequestAudio
    start: int  # offset of `new` in the piece's tokens
    new: Tensor  # [1, n] tokens whose frames this chunk makes
    lookahead: Tensor | None  # [1, 3] or None for the final chunk of a piece
    final: bool
    mel: Tensor | None = None

    @property
    def last_token(self) -> int:
        """Index in the piece's flow tokens of the last one this chunk reads (its look-ahead included)."""
        return self.start + self.new.shape[1] + (0 if self.lookahead is None else self.lookahead.shape[1]) - 1


class _RequestAudio:
    """A request's audio progress (vocoder thread only)."""

    def __init__(self, req: Request, flow: FlowBase, hift: HiFTBase, runner: FlowRunner | None,
                 family: ModelFamily, device: torch.device) -> None:
        self.req = req
        self.piece = 0
        self.fp32 = False  # switched after a NaN/inf chunk
        self.generator = torch.Generator(device).manual_seed(req.seed)
        self.parts: list[Tensor] = []  # non-streaming: audio of finished pieces
        self._flow, self._hift, self._runner, self._family = flow, hift, runner, family
        self._cfg = family.stream
        self.paged: PagedStream | None = None
        self.first_sent: float | None = None  # when the first streamed audio went out
        self.sent_s = 0.0  # seconds of streamed audio sent
        self.job: _Job | None = None  # a ready chunk held back until a round needs running (see `_collect`)
        self.job_ready = 0.0  # since when
        p = req.prompt
        paged = runner is not None and req.stream  # whole clips keep no paged history: no prefix to share
        self._key = flow_prompt_key(p.tokens, p.feat, p.embedding) if paged else None
        self._new_piece()

    def _new_piece(self) -> None:
        p = self.req.prompt
        self.schedule = HopSchedule(p.tokens.shape[1], self._cfg)
        self.flow_state: FlowStreamState | None = None  # whole clips run the full-attention flow, statelessly
        if self.req.stream:
            self.flow_state = self._flow.new_stream(p.tokens, p.feat, p.embedding)
            if self._runner is not None and not self.fp32:
                first_new = self.schedule.tokens_needed - self._cfg.pre_lookahead_len
                self.paged = self._runner.open(self.flow_state, self._key, first_new)
        self.hift_state = self._family.vocoder_state(self._hift)
        self.offset = 0
        self._keep = self._family.token_filter()
        self._flow_tokens: list[int] = []  # the piece's tokens that reach the flow (all of them without a filter)
        self._llm_index: list[int] = []  # the piece's index of each of them
        self._seen = 0  # the piece's tokens looked at so far

    def flow_tokens(self) -> list[int]:
        """The piece's tokens so far that the flow receives (the family's `token_filter`)."""
        tokens = self.req.pieces[self.piece].tokens
        if self._keep is None:
            return tokens
        for i in range(self._seen, len(tokens)):
            if self._keep(tokens[i]):
                self._flow_tokens.append(tokens[i])
                self._llm_index.append(i)
        self._seen = len(tokens)
        return self._flow_tokens

    def llm_index(self, i: int) -> int:
        """The piece's index of flow token `i`."""
        return i if self._keep is None else self._llm_index[i]

    def played(self, seconds: float) -> None:
        """Streamed audio sent: the listener's buffer grows by `seconds`."""
        if self.first_sent is None:
            self.first_sent = time.perf_counter()
        self.sent_s += seconds

    def due(self, now: float) -> float:
        """Seconds until this request's ready chunk must run (0: now): whole clips and first audio at once,
        listeners when less than `DUE_SLACK_S` of their audio is left or the chunk has waited `MAX_HOLD_S`."""
        if not self.req.stream or self.first_sent is None:
            return 0.0
        return max(0.0, min(self.slack(now) - DUE_SLACK_S, self.job_ready + MAX_HOLD_S - now))

    def slack(self, now: float) -> float:
        """Seconds until a streaming listener runs out of audio (playing from the first chunk on); before the first
        chunk, minus the time waited. Whole-clip requests have no listener yet: a slack as if just started."""
        if not self.req.stream:
            return 0.0
        if self.first_sent is None:
            return self.req.arrival - now
        return self.first_sent + self.sent_s - now

    def release(self) -> None:
        """Give the paged stream's pages and slot back (the piece ended, failed or moved to the eager path)."""
        if self.paged is not None:
            self._runner.close(self.paged)
            self.paged = None

    def next_job(self) -> _Job | None:
        """The next ready chunk (advancing the schedule), or None."""
        piece = self.req.pieces[self.piece]
        done, tokens = piece.done, self.flow_tokens()  # read `done` first: then `tokens` is complete when it is True
        la = self._cfg.pre_lookahead_len
        if self.req.stream:
            # a streamed text's hop stays at upstream's first while its text arrives: its tokens come at the text's
            # pace, too slowly to fill a doubled hop before the audio before it has played
            paced = self.req.feed is not None and self.req.feed.paced_by_text
            call = self.schedule.next_call(len(tokens), grow=not paced)
            if call is not None:
                ids = torch.tensor(tokens[call.token_offset:call.n_tokens_in])[None]
                self.offset = call.n_tokens_in - la
                return _Job(self, call.token_offset, ids[:, :-la], ids[:, -la:], final=False)
        if not done:
            return None
        return _Job(self, self.offset, torch.tensor(tokens[self.offset:], dtype=torch.long)[None], None, final=True)

    def piece_finished(self) -> bool:
        """After a final chunk: move to the next piece; True when that was the last one."""
        self.release()
        self.piece += 1
        if self.piece == len(self.req.pieces):
            return True
        self._new_piece()
        return False


class AudioWorker:
    def __init__(self, flow: FlowBase, hift: HiFTBase, policy: PrecisionPolicy, fallbacks: FallbackCounter,
                 sample_rate: int, flow_runner: FlowRunner | None = None, stream_cfg: StreamConfig | None = None,
                 cuda_graphs: bool = False, family: ModelFamily | None = None,
                 counters: VocoderCounters | None = None) -> None:
        """`family`: what differs per model family (default CosyVoice2's, with `stream_cfg` as its schedule)."""
        self.flow, self.hift, self.policy = flow, hift, policy
        self.family = family or CosyVoice2Family(ModelConfig(), stream_cfg)
        self.flow_runner = flow_runner
        self.hift_graphs = self.family.vocoder_graphs(hift, cuda_graphs)
        self._grow_to: tuple[int, int, Callable[[int, int], None]] | None = None
        self.device = next(flow.parameters()).device
        self.sample_rate = sample_rate
        self.stream_cfg = self.family.stream
        self.fallbacks = fallbacks
        self._flow32: FlowBase | None = None  # made on the first NaN/inf chunk
        self._active: dict[int, _RequestAudio] = {}
        self._arrived: list[Request] = []  # added by callers, set up by the vocoder thread (no GPU work in callers)
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._on_finish: Callable[[Request, bool | None], None] = lambda req, ok: None
        self._on_first_audio: Callable[[], None] = lambda: None
        self._on_fatal: Callable[[BaseException], None] = lambda error: None
        self._earliest_dry = float("inf")  # when the first playing stream runs out of audio (perf_counter time)
        self._starting = 0  # streams set up whose first audio is not out yet (as of the last look)
        self._round_times: deque[float] = deque(maxlen=ROUND_HISTORY)
        self._round_s = 0.0  # the longest of `_round_times`
        self._cuda_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.counters = flow_runner.counters if flow_runner is not None else counters or VocoderCounters()

    # ---- other threads ---------------------------------------------------------------------------------------
    @property
    def max_rows(self) -> int:
        return self.flow_runner.max_rows if self.flow_runner is not None else 64

    def capture_graphs(self) -> None:
        """Capture every flow and HiFT graph that serving can need (before `start`; CUDA graphs only). The HiFT
        graphs are captured in a thread of their own beside the flow's (each set has its own stream and memory pool
        and captures thread-locally): one thread's warm-ups run on the GPU while the other builds a graph. Building
        is Python's work under one interpreter lock, so the two overlap only in part (docs/benchmarks.md, run L)."""
        if self.flow_runner is not None:
            self.flow_runner.warm_up()  # before the HiFT thread starts capturing (see `FlowRunner.warm_up`)
        with ThreadPoolExecutor(1, thread_name_prefix="cosyvoice-hift-capture") as pool:
            hift = pool.submit(self.hift_graphs.capture_all, self.family.hift_shapes(self.max_rows, self.hift))
            if self.flow_runner is not None:
                self.flow_runner.capture_all()
            hift.result()

    def start(self, on_finish: Callable[[Request, bool | None], None],
              on_first_audio: Callable[[], None] = lambda: None,
              on_fatal: Callable[[BaseException], None] = lambda error: None) -> None:
        """`on_finish(req, ok)`: ok is None for a cancelled request. `on_first_audio()`: a round that made requests'
        first audio is over (their `first_audio_busy` is cleared; the scheduler may be holding decode for it).
        `on_fatal(error)`: a CUDA error poisoned the context (`faults.is_fatal`); the vocoder thread has stopped."""
        self._on_finish = on_finish
        self._on_first_audio = on_first_audio
        self._on_fatal = on_fatal
        self._thread = threading.Thread(target=self._loop, name="cosyvoice-vocoder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        for req in [voc.req for voc in self._active.values()] + self._arrived:
            req.fail(CosyVoiceError("the engine was closed"))
        self._active.clear()
        self._arrived.clear()

    @property
    def max_streams(self) -> int:
        """Requests whose audio can be in progress at once: one flow slot each."""
        runner = self.flow_runner
        if runner is not None:
            return runner.pool.num_slots - runner.max_prefixes
        return 1 << 30

    def pages_needed(self, req: Request, speech_tokens: int | None = None) -> int:
        """Flow pages the request can hold at most at once: its longest piece at its maximum length (or at
        `speech_tokens`), prompt included (a stream keeps the history of every chunk but the final one). Whole clips
        take none."""
        if not req.stream or self.flow_runner is None:
            return 0
        prompt = req.prompt.tokens.shape[1]
        return max(self.flow_runner.pages_for_tokens(prompt + (p.max_len if speech_tokens is None else speech_tokens))
                   for p in req.pieces)

    def load(self, now: float) -> VocoderLoad:
        """What admission weighs (any thread, lock-free): the audio that the playing stream closest to running out
        still has (as of the last round), how long rounds take now, and the admitted requests whose first audio is
        not out yet (those set up, as of the last look, and those handed over since)."""
        return VocoderLoad(self._earliest_dry - now, self._round_s, self._starting + len(self._arrived))

    def requests(self) -> list[Request]:
        """Every request whose audio is in progress (any thread; a snapshot)."""
        with self._cond:
            return [voc.req for voc in self._active.values()] + list(self._arrived)

    def add(self, req: Request) -> None:
        """Called when the request is admitted: only records it; its flow state is made by the vocoder thread, once
        its prompt is whole."""
        with self._cond:
            self._arrived.append(req)
            self._cond.notify_all()
        req.prompt.on_ready(self.notify)

    def grow(self, pages: int, slots: int, then: Callable[[int, int], None]) -> None:
        """Ask for a larger flow page pool (made by the vocoder thread between two rounds), then `then(pages,
        streams)` with what it has."""
        with self._cond:
            self._grow_to = (pages, slots, then)
            self._cond.notify_all()

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def idle(self) -> bool:
        """Lock-free (one atomic read), so it can be a predicate under another thread's condition."""
        return not self._active and not self._arrived

    # ---- the vocoder thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._grow_pool()
                jobs, wake = self._collect()
                while not jobs and not self._fresh_streams() and not self._stopping:
                    self._cond.wait(wake)
                    self._grow_pool()
                    jobs, wake = self._collect()
                if self._stopping:
                    return
            first = _mark_first_audio(jobs)
            t0 = time.perf_counter()
            self.counters.rounds += 1  # before its audio goes out: whoever hears it sees the round counted
            self.counters.chunks += len(jobs)
            try:
                if self._cuda_stream is None:
                    self._run(jobs)
                else:
                    self._cuda_stream.wait_stream(torch.cuda.default_stream(self.device))
                    with torch.cuda.stream(self._cuda_stream):
                        self._run(jobs)
            except Exception as e:
                if is_fatal(e):
                    self._on_fatal(e)
                    return
                log.exception("vocoder failed")
                with self._cond:
                    for job in jobs:
                        self._finish(job.voc, CosyVoiceError(f"synthesis failed: {type(e).__name__}"))
            finally:
                took = time.perf_counter() - t0
                self.counters.busy_s += took
                self._round_times.append(took)
                self._round_s = max(self._round_times)
                with self._cond:
                    self._note_playback()
                if first:
                    _clear_first_audio(first)
                    self._on_first_audio()
            del jobs, first  # do not keep the last round's request state alive while idle

    def _grow_pool(self) -> None:
        if self._grow_to is None or self.flow_runner is None:
            return
        pages, slots, then = self._grow_to
        self._grow_to = None
        try:
            self.flow_runner.grow(pages, slots)
        except torch.cuda.OutOfMemoryError:
            log.warning("no memory to grow the flow page pool to %d pages: it stays at %d", pages,
                        self.flow_runner.pool.num_pages)
        then(self.flow_runner.pool.num_pages, self.max_streams)

    def _collect(self) -> tuple[list[_Job], float | None]:
        """The next round's chunks, one per request (cancelled requests are dropped here), and when to look again if
        there is no round to run yet. Called with the lock held.

        A round costs about the same for a few rows as for many (launch-bound encoder, ten graph replays, HiFT), so
        rounds run only when some chunk is due: a whole clip, a stream's first audio, a listener with less than
        `DUE_SLACK_S` of audio left, or a chunk ready for `MAX_HOLD_S`. A round then takes the ready chunks along
        (`_round`); the others wait for it (their listeners have audio in hand), which makes fewer, larger rounds
        under load."""
        if not self._active and not self._arrived:  # idle: the next round times start afresh
            self._round_times.clear()
            self._round_s = 0.0
        self._arrived = [req for req in self._arrived if not self._set_up(req)]
        now, ready = time.perf_counter(), []
        for voc in list(self._active.values()):
            if voc.req.cancelled:
                self._finish(voc, None)
                continue
            if voc.job is None and (job := voc.next_job()) is not None:
                voc.job, voc.job_ready = job, now
            if voc.job is not None:
                ready.append(voc.job)
        self._note_playback()
        due = [job.voc.due(now) for job in ready]
        if not ready or min(due) > 0:
            return [], min(due, default=None)
        young = any(voc.req.stream and voc.req.chunks_sent < 2 for voc in self._active.values())
        streams = any(voc.req.stream for voc in self._active.values())
        jobs = _round(ready, now, bounded=young, streams=streams)
        for job in jobs:
            job.voc.job = None
        return jobs, None

    def _set_up(self, req: Request) -> bool:
        """Make an arrived request's audio state, once its prompt is whole (False: not yet). A prompt whose mel or
        x-vector failed fails its request alone. Called with the lock held."""
        if not req.prompt.ready():
            return False
        try:
            req.prompt.resolve()
        except Exception as e:
            log.error("request %d: its prompt's features failed: %r", req.id, e)
            req.cancel()
            req.fail(CosyVoiceError(f"the prompt audio's features failed ({type(e).__name__}: {e})"))
            self._on_finish(req, False)
            return True
        self._active[req.id] = _RequestAudio(req, self.flow, self.hift, self.flow_runner, self.family, self.device)
        return True

    def _fresh_streams(self) -> list[PagedStream]:
        """Paged streams whose prompt prefix is not resolved yet: it needs no speech token, so it is computed as soon
        as the request is admitted, while the LLM makes the tokens of its first chunk."""
        return [voc.paged for voc in self._active.values() if voc.paged is not None and voc.paged.fresh]

    def _note_playback(self) -> None:
        """When the first playing stream runs out of what it was sent, and how many have no audio out yet (the
        admission's look at the streams; a streamed text whose row waits for its text and has no chunk ready is not
        waiting for the vocoder)."""
        waiting = [voc for voc in self._active.values()
                   if voc.req.feed is None or voc.job is not None or not voc.req.feed.waits_for_text]
        self._earliest_dry = min((voc.first_sent + voc.sent_s for voc in waiting if voc.first_sent is not None),
                                 default=float("inf"))
        self._starting = sum(voc.first_sent is None for voc in waiting)

    def _finish(self, voc: _RequestAudio, error: BaseException | None) -> None:
        if self._active.pop(voc.req.id, None) is None:
            return
        voc.release()
        if error is not None:
            voc.req.fail(error)
        self._on_finish(voc.req, None if voc.req.cancelled else error is None)

    @torch.inference_mode()
    def _run(self, jobs: list[_Job]) -> None:
        """Flow for the round's chunks, batched (paged streams through the runner, the others eagerly), then HiFT and
        the audio out, batch by batch: when the paged chunks need several batches, the most urgent go first. Fresh
        streams' prompt prefixes are resolved before a chunk of their own in the round; the others' ride along with
        the round's first flow call where it has rows and pages to spare (`FlowRunner.ride_along`), or are computed
        after the round's audio has gone out."""
        paged = [job for job in jobs if job.voc.paged is not None]
        with self._cond:
            fresh = self._fresh_streams()
        in_round = {id(job.voc.paged) for job in paged}
        if now := [s for s in fresh if id(s) in in_round]:
            self.flow_runner.start_from_prefixes(now)
        paged, spare = self._fit_paged(paged)
        now = time.perf_counter()
        paged = by_urgency(paged, now)
        # grouped before any call: a call may switch a request to fp32 or end it, and it must not run twice
        eager = [job for job in jobs if job.voc.paged is None and job.voc.req.stream]
        groups = [group for fp32 in (False, True) if (group := [job for job in eager if job.voc.fp32 == fp32])]
        whole = [job for job in jobs if not job.voc.req.stream]
        rows = self.flow_runner.max_rows if self.flow_runner is not None else 1
        batches, riders = _batches(paged, rows, now), []
        if batches:
            riders = self.flow_runner.ride_along([s for s in fresh if id(s) not in in_round],
                                                 min(rows, ONE_BATCH_ROWS) - len(batches[0]), spare)
        for i, batch in enumerate(batches):
            self._flow_and_emit(batch, paged=True, riders=riders if i == 0 else [])
        for group in groups:
            self._flow_and_emit(group, paged=False)
        if whole:
            self._whole_and_emit(whole)
        with self._cond:  # read again: streams admitted meanwhile join, ended ones are gone
            fresh = self._fresh_streams()
        if fresh:
            self.flow_runner.start_from_prefixes(fresh)

    def _whole_and_emit(self, jobs: list[_Job]) -> None:
        """Whole clips: upstream's non-streaming flow (full attention over prompt and every token, one piece at a
        time), the speed change, then HiFT over the whole mel."""
        t0 = time.perf_counter()
        for job in jobs:
            job.mel = change_speed(self._whole_mel(job), job.voc.req.speed)
            job.voc.req.timings.flow += time.perf_counter() - t0
            t0 = time.perf_counter()
        self._vocode_and_emit(jobs)

    def _whole_mel(self, job: _Job) -> Tensor:
        """A piece's mel as upstream's `tts(stream=False)` makes it; non-finite in bf16/fp16, again in fp32."""
        p, tokens = job.voc.req.prompt, job.new.to(self.device)
        flow = self._fp32_flow() if job.voc.fp32 else self.flow
        args = (tokens, p.tokens.to(self.device), p.feat.to(self.device), p.embedding.to(self.device))
        mel = flow.inference(*args, streaming=False, finalize=True)
        if self.policy.guarded and not job.voc.fp32 and not to_host(mel.isfinite().all()).item():
            self.fallbacks.record("flow", f"request {job.voc.req.id}")
            job.voc.fp32 = True
            mel = self._fp32_flow().inference(*args, streaming=False, finalize=True)
        return mel

    def _flow_and_emit(self, jobs: list[_Job], paged: bool, riders: Sequence[PrefixRide] = ()) -> None:
        t0 = time.perf_counter()
        ready = self._flow_batch(jobs, paged, riders)
        for job in ready:
            job.voc.req.timings.flow += (time.perf_counter() - t0) / len(ready)
        self._vocode_and_emit(ready)

    def _fit_paged(self, jobs: list[_Job]) -> tuple[list[_Job], int]:
        """The paged jobs whose chunks fit in the free pages, and the free pages those chunks leave; the others
        continue eagerly from now on."""
        free, fit = len(self.flow_runner.pool.free_pages) if jobs else 0, []
        for job in jobs:
            need = self.flow_runner.pages_needed(job.voc.paged, job.new.shape[1], job.final)
            if need > free:  # cached prompt prefixes go first
                free += self.flow_runner.evict_prefixes()
            if need <= free:
                free -= need
                fit.append(job)
            else:
                log.warning("request %d: the flow page pool is full; it continues on the slower eager path",
                            job.voc.req.id)
                job.voc.release()
                job.voc.flow_state = self._rebuild(job, self.flow)
        return fit, free

    def _vocode_and_emit(self, jobs: list[_Job]) -> None:
        """HiFT for `jobs` as batches; out of memory, each request is retried alone (same random draws), and only
        one that fails alone fails. Audio that is not finite fails its request instead of reaching the user."""
        if not jobs:
            return
        t0 = time.perf_counter()
        draws = [job.voc.generator.get_state() for job in jobs]
        try:
            waves = self.family.vocode(self.hift, [job.voc.hift_state for job in jobs], [job.mel for job in jobs],
                                       [job.final for job in jobs], [job.voc.generator for job in jobs],
                                       self.hift_graphs, self.max_rows)
        except torch.cuda.OutOfMemoryError:
            if len(jobs) == 1:
                self._fail(jobs[0], "out of GPU memory in the vocoder; please retry")
                return
            log.warning("out of GPU memory vocoding %d chunks together: retrying them one at a time", len(jobs))
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            for job, state in zip(jobs, draws, strict=True):
                job.voc.generator.set_state(state)
                self._vocode_and_emit([job])
            return
        finite, pcms = to_pcm16(waves)  # the host sync of this round
        for job, ok, pcm in zip(jobs, finite, pcms, strict=True):
            job.voc.req.timings.hift += (time.perf_counter() - t0) / len(jobs)
            if not ok:
                log.error("request %d: the vocoder produced NaN/inf audio", job.voc.req.id)
                self._fail(job, "synthesis produced invalid audio (NaN/inf); try fp32 precision")
            else:
                self._emit(job, pcm)

    def _fail(self, job: _Job, message: str) -> None:
        with self._cond:
            self._finish(job.voc, CosyVoiceError(message))

    def _flow_batch(self, jobs: list[_Job], paged: bool, riders: Sequence[PrefixRide] = ()) -> list[_Job]:
        """One batched flow call for `jobs` (paged, or eager ones of one precision; paged ones take `riders` along)
        -> those that got their mel. Out of memory, each request is retried alone (without the riders, which stay
        fresh) and only one that fails alone fails; a non-finite low-precision row is recomputed in fp32 (and its
        request stays in fp32)."""
        fp32 = not paged and jobs[0].voc.fp32
        states = [job.voc.flow_state for job in jobs]
        snapshots = [state.snapshot() for state in states]
        args = ([job.new.to(self.device) for job in jobs], [_to(job.lookahead, self.device) for job in jobs],
                [job.final for job in jobs])
        try:
            if paged:
                mels = self.flow_runner.run([job.voc.paged for job in jobs], *args, riders=riders)
            else:
                mels = (self._fp32_flow() if fp32 else self.flow).stream_chunks(states, *args)
        except torch.cuda.OutOfMemoryError:
            if len(jobs) == 1:
                self._fail(jobs[0], "out of GPU memory in the flow decoder; please retry")
                return []
            log.warning("out of GPU memory in flow for %d chunks together: retrying them one at a time", len(jobs))
            for state, snapshot in zip(states, snapshots, strict=True):
                state.restore(snapshot)
            return [done for job in jobs for done in self._flow_batch([job], paged)]
        finite = [True] * len(jobs)
        if self.policy.guarded and not fp32:
            finite = to_host(torch.stack([mel.isfinite().all() for mel in mels])).tolist()  # one sync, GIL free
        for job, mel, ok in zip(jobs, mels, finite, strict=True):
            job.mel = mel if ok else self._recompute_fp32(job)
        return jobs

    def _recompute_fp32(self, job: _Job) -> Tensor:
        """A non-finite chunk again in fp32; its request continues eagerly in fp32."""
        self.fallbacks.record("flow", f"request {job.voc.req.id}")
        voc, flow32 = job.voc, self._fp32_flow()
        voc.release()
        voc.fp32 = True
        voc.flow_state = self._rebuild(job, flow32)
        return flow32.stream_chunk(voc.flow_state, job.new.to(self.device), _to(job.lookahead, self.device),
                                   job.final)

    def _rebuild(self, job: _Job, flow: FlowBase) -> FlowStreamState:
        """An eager state of `flow` for the job's piece that has consumed the tokens before the job (one chunk
        over all of them: the chunk-causal flow makes that equal to the chunks that were run)."""
        voc, p = job.voc, job.voc.req.prompt
        state = flow.new_stream(p.tokens, p.feat, p.embedding)
        if job.start:
            la = self.stream_cfg.pre_lookahead_len
            ids = torch.tensor(voc.flow_tokens()[: job.start + la], device=self.device)[None]
            flow.stream_chunk(state, ids[:, : job.start], ids[:, job.start :], False)
        return state

    def _fp32_flow(self) -> FlowBase:
        if self._flow32 is None:
            self._flow32 = copy.deepcopy(self.flow).float().fuse_projections_()
        return self._flow32

    def _emit(self, job: _Job, pcm: np.ndarray) -> None:
        voc, req = job.voc, job.voc.req
        last = job.final and voc.piece_finished()
        if req.stream:
            if len(pcm) or last:
                if req.feed is not None and req.chunks_sent == 0:
                    req.feed.source.first_audio_text_at = req.feed.text_arrival_for(voc.llm_index(job.last_token))
                req.send(pcm, self.sample_rate, is_last=last)
                voc.played(len(pcm) / self.sample_rate)
        elif job.final:
            voc.parts.append(pcm)
            if last:
                req.send(np.concatenate(voc.parts), self.sample_rate, is_last=True)
        if last:
            with self._cond:
                self._finish(voc, None)


def _mark_first_audio(jobs: list[_Job]) -> list[Request]:
    """Flag the streaming requests whose first audio this round makes (the scheduler holds decode while a lone running
    request is flagged); returns them. A function, so no loop variable keeps a request alive in the vocoder loop."""
    first = [job.voc.req for job in jobs if job.voc.req.stream and job.voc.req.chunks_sent == 0]
    for req in first:
        req.first_audio_busy = True
    return first


def _clear_first_audio(reqs: list[Request]) -> None:
    for req in reqs:
        req.first_audio_busy = False


def _round(ready: list[_Job], now: float, bounded: bool, streams: bool = False) -> list[_Job]:
    """What a round takes of the ready chunks: the urgent ones (first audio, whole clips, listeners with less than
    `URGENT_SLACK_S` left) and, while `bounded`, at most `ONE_BATCH_ROWS` others, those closest to running out first.
    While `streams` play, at most `WHOLE_CLIPS_PER_ROUND` whole clips, the longest waiting.

    A round is bounded while some stream is young (it has not played its second chunk yet): its first chunk carried
    1-2 s of audio and its second waits for the round in progress, so a round must not grow with the load (measured
    on the H200 at twice the capacity: every stream that ran dry did so before its second chunk). When every stream
    has audio in hand past that, a round takes every ready chunk: fewer, larger flow calls (many streams started
    together, as in the closed loop)."""
    ready = by_urgency(ready, now)
    if streams:
        clips = [job for job in ready if not job.voc.req.stream]
        waiting = {id(job) for job in sorted(clips, key=lambda job: job.voc.req.arrival)[WHOLE_CLIPS_PER_ROUND:]}
        ready = [job for job in ready if id(job) not in waiting]
    return ready[: _urgent(ready, now) + ONE_BATCH_ROWS] if bounded else ready


def _batches(jobs: list[_Job], rows: int, now: float) -> list[list[_Job]]:
    """Paged jobs, most urgent first (`by_urgency`), as flow batches of at most `rows`. A round small enough for one
    launch-bound batch (`ONE_BATCH_ROWS`) is one batch: a second flow call would cost as much again. A larger one puts
    the urgent chunks in a batch of their own ahead of the rest: the streams waiting for their first audio and the
    listeners with less than `URGENT_SLACK_S` of audio left (a young stream's second chunk, its first having carried
    1-2 s), a few chunks whose audio goes out before the large batch of listeners with audio in hand runs."""
    if len(jobs) <= min(rows, ONE_BATCH_ROWS):
        return [jobs] if jobs else []
    urgent = _urgent(jobs, now)
    return [group[i : i + rows] for group in (jobs[:urgent], jobs[urgent:]) for i in range(0, len(group), rows)]


def _urgent(jobs: list[_Job], now: float) -> int:
    """How many of `jobs`, sorted by slack (`by_urgency`), lead with less than `URGENT_SLACK_S` of it."""
    return sum(job.voc.slack(now) < URGENT_SLACK_S for job in jobs)


def by_urgency(jobs: list[_Job], now: float) -> list[_Job]:
    """Least slack first: requests still waiting for their first audio, longest waiting first, then listeners about
    to run out (earliest deadline first)."""
    return sorted(jobs, key=lambda job: job.voc.slack(now))


def _to(t: Tensor | None, device: torch.device) -> Tensor | None:
    return None if t is None else t.to(device)
