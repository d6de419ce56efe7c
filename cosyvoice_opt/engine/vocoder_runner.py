"""Tokens -> audio on a worker thread, so LLM decode steps keep going while flow and HiFT run.

Per request and text piece: a `HopSchedule` (upstream's chunking: first hop padded to the 25-token grid incl.
the prompt, hops doubling to 100, 3 look-ahead tokens), an incremental `FlowStreamState` (each chunk computes
only its new frames) and a `HiftStreamState` (mel/source caches and cross-fade). The flow chunks of every request
ready in a round run as one batched `Flow.stream_chunks` call (rows padded and masked), and their HiFT calls as one
batch per input shape. Each request draws HiFT's random source from its own generator (seeded by the request seed), so
its audio does not depend on what else is in the batch.

Non-streaming requests take the same path with one final chunk per piece: the block-causal flow then gives the
same mel as the concatenated streaming chunks, so both modes agree (see tests/test_engine.py for the bound).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from cosyvoice_opt.engine.precision import FallbackCounter, PrecisionPolicy
from cosyvoice_opt.engine.scheduler import Request
from cosyvoice_opt.engine.token2wav import HiftStreamState, HopSchedule, StreamConfig, change_speed
from cosyvoice_opt.errors import CosyVoiceError
from cosyvoice_opt.models.flow import Flow, FlowStreamState
from cosyvoice_opt.models.hift import HiFT

log = logging.getLogger(__name__)


def to_pcm16(wave: Tensor) -> np.ndarray:
    """Float audio in [-1, 1] -> int16 (no per-chunk normalisation: chunks must not change loudness)."""
    return (wave.float().clamp(-1, 1) * 32767).round().to(torch.int16).cpu().numpy().reshape(-1)


@dataclass
class _Job:
    """One flow + HiFT chunk of one request."""

    voc: _RequestAudio
    new: Tensor  # [1, n] tokens whose frames this chunk makes
    lookahead: Tensor | None  # [1, 3] or None for the final chunk of a piece
    final: bool
    mel: Tensor | None = None


class _RequestAudio:
    """A request's audio progress (vocoder thread only)."""

    def __init__(self, req: Request, flow: Flow, stream_cfg: StreamConfig, device: torch.device) -> None:
        self.req = req
        self.piece = 0
        self.fp32 = False  # switched after a NaN/inf chunk
        self.generator = torch.Generator(device).manual_seed(req.seed)
        self.parts: list[Tensor] = []  # non-streaming: audio of finished pieces
        self._flow, self._cfg = flow, stream_cfg
        self._new_piece()

    def _new_piece(self) -> None:
        p = self.req.prompt
        self.schedule = HopSchedule(p.tokens.shape[1], self._cfg)
        self.flow_state: FlowStreamState = self._flow.new_stream(p.tokens, p.feat, p.embedding)
        self.hift_state = HiftStreamState(self._cfg)
        self.offset = 0

    def next_job(self) -> _Job | None:
        """The next ready chunk (advancing the schedule), or None."""
        piece = self.req.pieces[self.piece]
        done, tokens = piece.done, piece.tokens  # read `done` first: then `tokens` is complete when it is True
        la = self._cfg.pre_lookahead_len
        if self.req.stream:
            call = self.schedule.next_call(len(tokens))
            if call is not None:
                ids = torch.tensor(tokens[call.token_offset:call.n_tokens_in])[None]
                self.offset = call.n_tokens_in - la
                return _Job(self, ids[:, :-la], ids[:, -la:], final=False)
        if not done:
            return None
        return _Job(self, torch.tensor(tokens[self.offset:], dtype=torch.long)[None], None, final=True)

    def piece_finished(self) -> bool:
        """After a final chunk: move to the next piece; True when that was the last one."""
        self.piece += 1
        if self.piece == len(self.req.pieces):
            return True
        self._new_piece()
        return False


class VocoderRunner:
    def __init__(self, flow: Flow, hift: HiFT, policy: PrecisionPolicy, fallbacks: FallbackCounter,
                 sample_rate: int, stream_cfg: StreamConfig | None = None) -> None:
        self.flow, self.hift, self.policy = flow, hift, policy
        self.device = next(flow.parameters()).device
        self.sample_rate = sample_rate
        self.stream_cfg = stream_cfg or StreamConfig()
        self.fallbacks = fallbacks
        self._flow32: Flow | None = None  # made on the first NaN/inf chunk
        self._active: dict[int, _RequestAudio] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._on_finish: Callable[[Request, bool | None], None] = lambda req, ok: None
        self._cuda_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ---- other threads ---------------------------------------------------------------------------------------
    def start(self, on_finish: Callable[[Request, bool | None], None]) -> None:
        """`on_finish(req, ok)`: ok is None for a cancelled request."""
        self._on_finish = on_finish
        self._thread = threading.Thread(target=self._loop, name="cosyvoice-vocoder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        for voc in self._active.values():
            voc.req.fail(CosyVoiceError("the engine was closed"))
        self._active.clear()

    def add(self, req: Request) -> None:
        with self._cond:
            self._active[req.id] = _RequestAudio(req, self.flow, self.stream_cfg, self.device)

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def idle(self) -> bool:
        """Lock-free (one atomic read), so it can be a predicate under another thread's condition."""
        return not self._active

    # ---- the vocoder thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                jobs = self._collect()
                while not jobs and not self._stopping:
                    self._cond.wait()
                    jobs = self._collect()
                if self._stopping:
                    return
            try:
                if self._cuda_stream is None:
                    self._run(jobs)
                else:
                    self._cuda_stream.wait_stream(torch.cuda.default_stream(self.device))
                    with torch.cuda.stream(self._cuda_stream):
                        self._run(jobs)
            except Exception as e:
                log.exception("vocoder failed")
                for job in jobs:
                    self._finish(job.voc, CosyVoiceError(f"synthesis failed: {type(e).__name__}"))
            del jobs  # do not keep the last round's request state alive while idle

    def _collect(self) -> list[_Job]:
        """One ready chunk per request (cancelled requests are dropped here). Called with the lock held."""
        jobs = []
        for voc in list(self._active.values()):
            if voc.req.cancelled:
                self._finish(voc, None)
            elif (job := voc.next_job()) is not None:
                jobs.append(job)
        return jobs

    def _finish(self, voc: _RequestAudio, error: BaseException | None) -> None:
        if self._active.pop(voc.req.id, None) is None:
            return
        if error is not None:
            voc.req.fail(error)
        self._on_finish(voc.req, None if voc.req.cancelled else error is None)

    @torch.inference_mode()
    def _run(self, jobs: list[_Job]) -> None:
        """Flow for every ready chunk, batched (requests switched to fp32 on the fp32 copy), then HiFT."""
        t0 = time.perf_counter()
        # grouped before any call: a call may switch a request to fp32, and it must not run twice
        groups = {fp32: [job for job in jobs if job.voc.fp32 == fp32] for fp32 in (False, True)}
        ready = []
        for fp32, group in groups.items():
            if group:
                ready += self._flow_batch(group, fp32)
        for job in ready:
            job.voc.req.timings.flow += (time.perf_counter() - t0) / len(ready)
            if not job.voc.req.stream:
                job.mel = change_speed(job.mel, job.voc.req.speed)
        self._vocode_and_emit(ready)

    def _vocode_and_emit(self, jobs: list[_Job]) -> None:
        """HiFT for `jobs` as batches; out of memory, each request is retried alone (same random draws), and only
        one that fails alone fails. Audio that is not finite fails its request instead of reaching the user."""
        if not jobs:
            return
        t0 = time.perf_counter()
        draws = [job.voc.generator.get_state() for job in jobs]
        try:
            waves = self._vocode(jobs)
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
        for job, wave in zip(jobs, waves, strict=True):
            finite = torch.isfinite(wave).all()
            pcm = to_pcm16(wave)  # the host sync of this round (`finite` is ready with it)
            job.voc.req.timings.hift += (time.perf_counter() - t0) / len(jobs)
            if not bool(finite):
                log.error("request %d: the vocoder produced NaN/inf audio", job.voc.req.id)
                self._fail(job, "synthesis produced invalid audio (NaN/inf); try fp32 precision")
            else:
                self._emit(job, pcm)

    def _fail(self, job: _Job, message: str) -> None:
        with self._cond:
            self._finish(job.voc, CosyVoiceError(message))

    def _flow_batch(self, jobs: list[_Job], fp32: bool) -> list[_Job]:
        """One batched flow call for `jobs` -> those that got their mel. Out of memory, each request is retried
        alone and only one that fails alone fails; a non-finite low-precision row is recomputed in fp32 (and its
        request stays in fp32)."""
        flow = self._fp32_flow() if fp32 else self.flow
        states = [job.voc.flow_state for job in jobs]
        snapshots = [_snapshot(state) for state in states]  # carries are append-only: this copies lists only
        try:
            mels = flow.stream_chunks(states, [job.new.to(self.device) for job in jobs],
                                      [_to(job.lookahead, self.device) for job in jobs], [job.final for job in jobs])
        except torch.cuda.OutOfMemoryError:
            if len(jobs) == 1:
                self._fail(jobs[0], "out of GPU memory in the flow decoder; please retry")
                return []
            log.warning("out of GPU memory in flow for %d chunks together: retrying them one at a time", len(jobs))
            for state, snapshot in zip(states, snapshots, strict=True):
                _restore(state, snapshot)
            return [done for job in jobs for done in self._flow_batch([job], fp32)]
        finite = [True] * len(jobs)
        if self.policy.guarded and not fp32:
            finite = torch.stack([mel.isfinite().all() for mel in mels]).tolist()  # one sync for the batch
        for job, mel, ok, snapshot in zip(jobs, mels, finite, snapshots, strict=True):
            if ok:
                job.mel = mel
                continue
            self.fallbacks.record("flow", f"request {job.voc.req.id}")
            job.voc.fp32 = True
            _restore(job.voc.flow_state, snapshot, to_fp32=True)
            job.mel = self._fp32_flow().stream_chunk(job.voc.flow_state, job.new.to(self.device),
                                                     _to(job.lookahead, self.device), job.final)
        return jobs

    def _fp32_flow(self) -> Flow:
        if self._flow32 is None:
            self._flow32 = copy.deepcopy(self.flow).float()
        return self._flow32

    def _vocode(self, jobs: list[_Job]) -> list[Tensor]:
        """HiFT for every job; jobs whose inputs have equal shapes share one batch."""
        inputs = [job.voc.hift_state.prepare(job.mel.to(self.policy.hift)) for job in jobs]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (mel_in, cache) in enumerate(inputs):
            groups.setdefault((mel_in.shape[2], 0 if cache is None else cache.shape[2]), []).append(i)
        out: list[Tensor | None] = [None] * len(jobs)
        decoded: dict[int, tuple[Tensor, Tensor]] = {}
        hift = self.hift
        for idx in groups.values():
            mel_in = torch.cat([inputs[i][0] for i in idx])
            if mel_in.shape[2] == 0:  # a piece that ended before its first frame
                for i in idx:
                    out[i] = mel_in.new_zeros(1, 0)
                continue
            f0 = hift.f0(mel_in)
            n, dim = mel_in.shape[2] * hift.cfg.upsample_scale, hift.m_source.dim
            gens = [jobs[i].voc.generator for i in idx]
            kw = {"device": mel_in.device, "dtype": mel_in.dtype}
            phases = torch.cat([torch.rand(1, dim, generator=g, **kw) for g in gens])
            noise = torch.cat([torch.randn(1, n, dim, generator=g, **kw) for g in gens])
            source = hift.source(f0, phases, noise)
            if inputs[idx[0]][1] is not None:
                cache = torch.cat([inputs[i][1] for i in idx])
                source = torch.cat([cache.to(source.dtype), source[..., cache.shape[-1]:]], dim=-1)
            speech = hift.decode(mel_in, source)
            for row, i in enumerate(idx):
                decoded[i] = speech[row:row + 1], source[row:row + 1]
        # the caches change only now that every batch ran: an out-of-memory retry starts from the same state
        for i, (speech, source) in decoded.items():
            out[i] = jobs[i].voc.hift_state.finish(inputs[i][0], speech, source, jobs[i].final)
        return out

    def _emit(self, job: _Job, pcm: np.ndarray) -> None:
        voc, req = job.voc, job.voc.req
        last = job.final and voc.piece_finished()
        if req.stream:
            if len(pcm) or last:
                req.send(pcm, self.sample_rate, is_last=last)
        elif job.final:
            voc.parts.append(pcm)
            if last:
                req.send(np.concatenate(voc.parts), self.sample_rate, is_last=True)
        if last:
            with self._cond:
                self._finish(voc, None)


def _to(t: Tensor | None, device: torch.device) -> Tensor | None:
    return None if t is None else t.to(device)


def _snapshot(state: FlowStreamState) -> tuple:
    """Carries are never modified in place, so copying their slot lists (and the list of step carries, which the
    first chunk creates) is a full snapshot."""
    carries = [(c, list(c.slots), c.pos) for c in [state.encoder, *state.steps]]
    return state.pending, state.finished, list(state.steps), carries


def _restore(state: FlowStreamState, snapshot: tuple, to_fp32: bool = False) -> None:
    """Undo a failed chunk; with `to_fp32`, also convert the state for the fp32 flow copy."""
    state.pending, state.finished, state.steps, carries = snapshot
    for carry, slots, pos in carries:
        carry.slots, carry.pos = [t.float() if to_fp32 and t.is_floating_point() else t for t in slots], pos
    if to_fp32:
        state.spks = state.spks.float()
