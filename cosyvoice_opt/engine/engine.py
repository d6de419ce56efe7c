"""The public engine: requests in, int16 audio chunks out.

Threads: callers run the frontend (validation, prompt features, text layout) in their own thread, so a bad
request fails before it is queued and ONNX work never blocks the GPU loop; one engine thread runs the LLM
(`Scheduler.step`); one vocoder thread turns tokens into audio (`AudioWorker`). Results reach the caller
through a per-request queue.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from cosyvoice_opt.checkpoint import LoadedModel, find_model_dir, load_model
from cosyvoice_opt.config import SPEECH_TOKENIZER_CHOICES, Family
from cosyvoice_opt.engine.admission import ROOM_FIRST_TOKENS, Admission
from cosyvoice_opt.engine.audio_worker import AudioWorker
from cosyvoice_opt.engine.backends import configure_backends
from cosyvoice_opt.engine.bistream import BistreamFeed
from cosyvoice_opt.engine.counters import VocoderCounters
from cosyvoice_opt.engine.family import ModelFamily
from cosyvoice_opt.engine.faults import is_fatal
from cosyvoice_opt.engine.flow_runner import FlowRunner
from cosyvoice_opt.engine.host_memory import limit_malloc_arenas
from cosyvoice_opt.engine.llm_runner import LLMRunner
from cosyvoice_opt.engine.precision import FallbackCounter, PrecisionPolicy, validate_precision
from cosyvoice_opt.engine.scheduler import FlowPrompt, Request, Scheduler, TextPiece
from cosyvoice_opt.engine.torch_speech_tokenizer import TorchSpeechTokenizer
from cosyvoice_opt.errors import (
    CheckpointError,
    CosyVoiceError,
    EngineDead,
    InputError,
    PromptTooLong,
    first_sentence,
)
from cosyvoice_opt.frontend.audio import PromptAudio, decode_audio, trim_silence, validate
from cosyvoice_opt.frontend.features import PendingFeatures, PromptFeatures, start_prompt_features, then
from cosyvoice_opt.frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
from cosyvoice_opt.frontend.prompt_cache import PromptCache, prompt_key
from cosyvoice_opt.frontend.text_normalize import split_text
from cosyvoice_opt.frontend.tokenizer import TextTokenizer, build_text_inputs, prompt_ids
from cosyvoice_opt.frontend.voices import SavedVoice, VoiceStore, check_name, family_name
from cosyvoice_opt.limits import (
    MAX_QUEUE_WAIT_RANGE,
    MAX_QUEUE_WAIT_S,
    MAX_SEED,
    SPEED_RANGE,
    TEXT_IDLE_RANGE,
    TEXT_IDLE_S,
)
from cosyvoice_opt.models.bistream import UPSTREAM, BistreamFixes, BistreamPlan
from cosyvoice_opt.random_model import random_model
from cosyvoice_opt.types import AudioChunk, Mode, SynthesisRequest, TextStream

log = logging.getLogger(__name__)

MAX_SEQ = {"cuda": 2048, "cpu": 1024}  # KV positions per slot: prompt + text + generated tokens of one piece
KV_MEMORY_FRACTION = 0.5  # of the free GPU memory after warm-up, at most, for the KV cache
MAX_FLOW_ROWS = 64  # streams in one flow batch (a round with more runs several)
FLOW_PAGES_PER_STREAM = 16  # paged estimator history per concurrent request (a page is 50 frames = 1 s of audio)
FLOW_MEMORY_FRACTION = 0.5  # of the free GPU memory after the KV cache, at most, for the flow pages
MIN_ROOM = 64  # KV positions a prompt must leave free for text and speech in one request
WARMUP = {"cuda": (75, 250), "cpu": (0, 64)}  # (prompt, speech) tokens: a 3 s prompt and 10 s of speech on CUDA


def check_request(r: SynthesisRequest) -> Mode:
    """Every check that needs no model (types, ranges, required fields): run first, so a bad request is rejected in
    microseconds, before any audio decoding or model work. Returns the mode."""
    try:
        mode = Mode(r.mode)
    except ValueError:
        raise InputError(f"Unknown mode {r.mode!r}; choose one of {', '.join(m.value for m in Mode)}.") from None
    if not isinstance(r.seed, int) or isinstance(r.seed, bool) or not 0 <= r.seed <= MAX_SEED:
        raise InputError(f"seed must be an integer from 0 to {MAX_SEED}, got {str(r.seed)[:40]}")
    if isinstance(r.speed, bool) or not isinstance(r.speed, int | float) or not math.isfinite(r.speed) \
            or not SPEED_RANGE[0] <= r.speed <= SPEED_RANGE[1]:
        raise InputError(f"speed must be a number between {SPEED_RANGE[0]} and {SPEED_RANGE[1]}, "
                         f"got {str(r.speed)[:40]}")
    if r.stream and r.speed != 1.0:
        raise InputError("speed can only be changed without streaming (turn streaming off)")
    for name in ("max_tokens", "force_tokens"):
        value = getattr(r, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    for name in ("prompt_text", "instruct_text"):
        if not isinstance(getattr(r, name), str):
            raise InputError(f"{name} must be a string")
    if r.voice is not None:
        check_name(r.voice)
    elif mode == Mode.SFT:
        raise InputError("SFT mode needs a speaker: choose a saved voice")
    elif r.prompt_audio is None:
        raise InputError(f"{mode.value} mode needs prompt audio (or a saved voice)")
    elif mode == Mode.ZERO_SHOT and not r.prompt_text.strip():
        raise InputError("zero-shot cloning needs the transcript of the prompt audio as prompt text "
                         "(use cross-lingual mode when there is none)")
    if mode == Mode.INSTRUCT2 and not r.instruct_text.strip():
        raise InputError('instruct2 mode needs an instruction, e.g. "speak happily"')
    return mode


@dataclass
class EngineConfig:
    precision: str = "auto"  # fp32 | fp16 | bf16 | auto (bf16 on CUDA, fp32 on CPU)
    max_batch_size: int = 64  # LLM continuous-batching limit, live-adjustable
    device: str | None = None  # None = cuda if available else cpu
    random_size: str | None = None  # "tiny" | "full": a seeded random-weight model instead of a folder
    family: str = Family.COSYVOICE2.value  # the random model's family (a folder's is read from its files)
    seed: int = 0  # random-model weight seed
    voices_dir: str = "voices"
    prompt_cache_bytes: int = 256 << 20
    warmup: bool = True
    cuda_graphs: bool = True
    compile: bool = False  # torch.compile the LLM decode step (CUDA graphs only): faster decode, slower start
    max_queue_wait: float = MAX_QUEUE_WAIT_S  # a request that cannot start within this many seconds is refused busy
    exit_on_fatal: bool = False  # servers: exit the process (code 70) when a CUDA error makes the GPU unusable
    text_idle_timeout: float = TEXT_IDLE_S  # streamed text that stops arriving this long ends its request
    bistream_fixes: BistreamFixes = UPSTREAM  # streamed text: upstream's quirks, or which of them to fix
    speech_tokenizer: str = "auto"  # one of SPEECH_TOKENIZER_CHOICES (torch: an error if the file does not fit)

    def __post_init__(self) -> None:
        validate_precision(self.precision)
        if self.max_batch_size < 1:
            raise InputError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.random_size not in (None, "tiny", "full"):
            raise InputError(f"random_size must be 'tiny' or 'full', got {self.random_size!r}")
        if self.family not in [f.value for f in Family]:
            raise InputError(f"family must be one of {', '.join(f.value for f in Family)}, got {self.family!r}")
        check_queue_wait(self.max_queue_wait)
        if self.speech_tokenizer not in SPEECH_TOKENIZER_CHOICES:
            raise InputError(f"speech_tokenizer must be one of {', '.join(SPEECH_TOKENIZER_CHOICES)}, got "
                             f"{self.speech_tokenizer!r}")
        lo, hi = TEXT_IDLE_RANGE
        if isinstance(self.text_idle_timeout, bool) or not isinstance(self.text_idle_timeout, int | float) \
                or not lo <= self.text_idle_timeout <= hi:
            raise InputError(f"text idle timeout must be a number of seconds from {lo:g} to {hi:g}, got "
                             f"{self.text_idle_timeout!r}")


def check_queue_wait(seconds: float) -> None:
    lo, hi = MAX_QUEUE_WAIT_RANGE
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not lo <= seconds <= hi:
        raise InputError(f"max queue wait must be a number of seconds from {lo:g} to {hi:g}, got {seconds!r}")


@dataclass
class _Parts:
    """Everything that depends on the precision (rebuilt by `set_precision`)."""

    model: LoadedModel
    family: ModelFamily
    policy: PrecisionPolicy
    runner: LLMRunner
    vocoder: AudioWorker


class Engine:
    def __init__(self, load: Callable[[torch.device], LoadedModel], config: EngineConfig) -> None:
        """`load(device)` returns a fresh fp32 model (called again by `set_precision`)."""
        self.config = config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._load = load
        self.fallbacks = FallbackCounter()
        self._sched: Scheduler | None = None
        configure_backends()  # before the first kernel: cuDNN reads its plan cache bound once
        limit_malloc_arenas()  # before the serving threads start
        self.vocoder_counters = VocoderCounters()  # shared by every vocoder this engine builds
        # where start-up goes (s): the model, the LLM's KV cache and graphs, the flow page pool, the frontend, the
        # flow and HiFT graphs, the warm-up, and in all since the process started (imports included)
        self.startup_s: dict[str, float] = {}
        self._parts = self._build(config.precision, self.startup_s)
        model = self._parts.model
        self.sample_rate = model.config.sample_rate
        self.fatal_error: str | None = None  # set when a CUDA error made the GPU unusable: every request fails
        vocoder = self._parts.vocoder
        admission = Admission(vocoder.flow_runner.pool.num_pages, vocoder.max_streams, config.max_queue_wait)
        self._sched = Scheduler(config.max_batch_size, self.family.stop_token_ids, admission,
                                on_admit=lambda req: self._parts.vocoder.add(req),
                                vocoder_load=lambda now: self._parts.vocoder.load(now),
                                pages_for=lambda req, tokens: self._parts.vocoder.pages_needed(req, tokens))
        self._control: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._drained = threading.Condition()
        self._switch_lock = threading.Lock()
        self._closed = False  # no new requests (closing, or the GPU failed)
        self._shut = False  # `close` ran
        with ThreadPoolExecutor(1, thread_name_prefix="cosyvoice-frontend-load") as loader:
            frontend = loader.submit(self._load_frontend, model, config)
            t0 = time.perf_counter()
            self._parts.vocoder.capture_graphs()
            self.startup_s["flow_hift_graphs"] = time.perf_counter() - t0
        frontend.result()
        self._speech_tokenizer_in_torch(model, config.speech_tokenizer)
        self._parts.vocoder.start(self._finished, self._sched.poke, self._fatal)
        self._thread = threading.Thread(target=self._loop, name="cosyvoice-llm", daemon=True)
        self._thread.start()
        t0 = time.perf_counter()
        if config.warmup:
            self._warmup()
        self.startup_s["warmup"] = time.perf_counter() - t0
        self.startup_s["process"] = time.time() - psutil.Process().create_time()
        log.info("engine ready on %s (%s, %s), %.1f s after the process started: %s", self.device, model.description,
                 self._parts.policy.name, self.startup_s["process"],
                 ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_s.items() if k != "process"))

    def _load_frontend(self, model: LoadedModel, config: EngineConfig) -> None:
        """Tokenizer, ONNX sessions, prompt cache, voices: host work, so it runs in a thread beside the graph
        captures."""
        t0 = time.perf_counter()
        self.tokenizer = TextTokenizer.from_folder(model.tokenizer_dir, model.family)
        required = model.config.llm.required_text_id
        if required is not None and self.tokenizer.endofprompt_id != required:
            raise CheckpointError(f"{model.tokenizer_dir.name}/ in {model.model_dir}: <|endofprompt|> is id "
                                  f"{self.tokenizer.endofprompt_id}, but the {model.family.value} LLM finds it by id "
                                  f"{required} (the released Qwen2 vocabulary's): use the tokenizer folder released "
                                  "with the model")
        self.speech_tokenizer = SpeechTokenizer(model.speech_tokenizer_path)
        self.speaker_encoder = SpeakerEncoder(model.campplus_path)
        self.prompt_cache = PromptCache(config.prompt_cache_bytes)
        self.voices = VoiceStore(config.voices_dir, family=model.family)
        spk = model.spk2info_path
        self._spk2info = torch.load(spk, map_location="cpu", weights_only=True) if spk.is_file() else {}
        self.startup_s["frontend"] = time.perf_counter() - t0

    def _speech_tokenizer_in_torch(self, model: LoadedModel, choice: str) -> None:
        """The speech tokenizer in PyTorch on the engine's device (`torch_speech_tokenizer`) in place of
        onnxruntime's, as `EngineConfig.speech_tokenizer` says, with a lone prompt's forward captured per padded length.
        After the flow's and HiFT's graph captures: it allocates."""
        if choice == "onnx" or (choice == "auto" and self.device.type != "cuda"):
            return
        t0 = time.perf_counter()
        try:
            tokenizer = TorchSpeechTokenizer.load(model.speech_tokenizer_path, self.device, self.speech_tokenizer)
            if self.config.cuda_graphs:
                tokenizer.capture_graphs()
            self.speech_tokenizer = tokenizer
        except (CheckpointError, torch.cuda.OutOfMemoryError) as e:
            if choice == "torch":
                raise
            log.warning("the speech tokenizer runs in onnxruntime on the host: %s", first_sentence(e))
        self.startup_s["speech_tokenizer"] = time.perf_counter() - t0

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None, config: EngineConfig | None = None) -> Engine:
        """A model folder; with None and no `random_size`: `find_model_dir`, else a built-in random model
        (full size on CUDA, tiny on CPU)."""
        config = config or EngineConfig()
        size, folder = config.random_size, None
        if size is None:
            folder = find_model_dir(model_dir)
            if folder is None:
                cuda = (config.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
                size = "full" if cuda else "tiny"
                log.warning("no model folder found: using a random-weight %s model (the audio is noise)", size)
        if size is not None:
            return cls(lambda device: random_model(size, config.seed, device, family=config.family), config)
        return cls(lambda device: load_model(folder, device), config)

    # ---- building ------------------------------------------------------------------------------------------
    def _build(self, precision: str, times: dict[str, float] | None = None) -> _Parts:
        """The model at `precision` and what serves it; `times` gets the seconds of each part."""
        times = {} if times is None else times
        t0 = time.perf_counter()
        policy = PrecisionPolicy.resolve(precision, self.device)
        model = self._load(self.device)
        model.llm.to(policy.llm).eval()
        model.llm.backbone.fuse_projections_()  # after the last .to(): moving it would undo the fusion's aliasing
        model.flow.to(policy.flow).eval().fuse_projections_()  # after its last .to(), like the LLM
        model.hift.to(policy.hift).eval().fuse_weight_norm()
        old = getattr(self, "_parts", None)
        num_slots = old.runner.num_slots if old else self._slots_for(self.config.max_batch_size, model, policy)
        t1 = time.perf_counter()
        times["model"] = t1 - t0
        runner = LLMRunner(model.llm, num_slots, MAX_SEQ[self.device.type], policy.llm, self.device,
                           self.config.cuda_graphs, self.config.compile)
        t2 = time.perf_counter()
        times["llm"] = t2 - t1
        # sized from what is free now: in a precision switch the old pool still exists (it keeps serving if this
        # fails), so the new one may start smaller; `set_precision` grows it once the old one is gone
        family = ModelFamily.for_model(model.config)
        flow_runner = family.flow_runner(model.flow, lambda: self._flow_room(num_slots, 0, model, policy),
                                         self.config.cuda_graphs, max_rows=min(MAX_FLOW_ROWS, 2 * num_slots),
                                         max_tokens=MAX_SEQ[self.device.type], counters=self.vocoder_counters)
        vocoder = AudioWorker(model.flow, model.hift, policy, self.fallbacks, model.config.sample_rate, flow_runner,
                              cuda_graphs=self.config.cuda_graphs, family=family, counters=self.vocoder_counters)
        times["flow_pool"] = time.perf_counter() - t2
        return _Parts(model, family, policy, runner, vocoder)

    def _flow_room(self, streams: int, pages: int, model: LoadedModel, policy: PrecisionPolicy) -> tuple[int, int]:
        """(pages, slots) of a flow page pool for `streams` concurrent requests, growing one of `pages` by at most
        a fraction of the free device memory (host memory on CPU: a full-size model's pages are 57 MB in fp32), and
        never smaller than one request of the longest accepted piece needs. Slots are twice the streams: audio goes
        on after a request's LLM ends."""
        flow = model.flow
        longest = MAX_SEQ[self.device.type] * flow.cfg.token_mel_ratio // flow.decoder.estimator.chunk
        want = max(streams * FLOW_PAGES_PER_STREAM, longest)
        if want > pages:
            cuda = self.device.type == "cuda"
            free = torch.cuda.mem_get_info(self.device)[0] if cuda else psutil.virtual_memory().available
            fit = int(free * FLOW_MEMORY_FRACTION) // FlowRunner.bytes_per_page(model.flow, policy.flow)
            if pages + fit < want:
                log.warning("flow page pool: room for %d pages, not %d; more streams run on the eager path",
                            pages + fit, want)
            want = min(want, pages + fit)
        return max(want, pages), 2 * streams

    def _slots_for(self, wanted: int, model: LoadedModel, policy: PrecisionPolicy) -> int:
        """KV slots for `wanted` requests, capped by the free GPU memory (all of them on CPU)."""
        if self.device.type != "cuda":
            return wanted
        per_slot = LLMRunner.bytes_per_slot(model.llm.cfg, MAX_SEQ["cuda"], policy.llm)
        free, _ = torch.cuda.mem_get_info(self.device)
        fit = max(1, int(free * KV_MEMORY_FRACTION) // per_slot)
        if fit < wanted:
            log.warning("KV cache: room for %d concurrent requests, not %d", fit, wanted)
        return min(wanted, fit)

    def _warmup(self) -> None:
        """One forced request through LLM, flow and HiFT: kernels, allocator and graphs are hot afterwards."""
        cfg, (n_prompt, n_speech) = self._parts.model.config, WARMUP[self.device.type]
        prompt = FlowPrompt(torch.zeros(1, n_prompt, dtype=torch.int32),
                            torch.zeros(1, cfg.flow.token_mel_ratio * n_prompt, cfg.flow.output_size),
                            torch.zeros(1, cfg.flow.spk_embed_dim))
        prompt = FlowPrompt(*(self._host(t) for t in dataclasses.astuple(prompt)))
        text = torch.arange(1, 11)
        if cfg.llm.required_text_id is not None:  # CosyVoice3's LLM needs <|endofprompt|> in its text
            text[-1] = cfg.llm.required_text_id
        piece = TextPiece(self._host(text), None, 0, n_speech)
        req = Request([piece], prompt, stream=True, speed=1.0, seed=0, force_tokens=n_speech,
                      arrival=time.perf_counter(), frontend_s=0.0)
        req.pages, req.internal = self._parts.vocoder.pages_needed(req), True
        for _ in self._submit(req):
            pass

    # ---- the engine thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        sched = self._sched
        while True:
            sched.wait()
            while not self._control.empty():
                try:
                    self._control.get()()
                except Exception:  # e.g. no memory for more slots: keep serving with what there is
                    log.exception("engine setting change failed")
            if self._closed:
                return
            parts = self._parts
            try:
                touched = sched.step(parts.runner)
            except Exception as e:  # never let one bad step kill the engine: fail what ran, keep serving
                if is_fatal(e):
                    self._fatal(e)
                    return
                log.exception("LLM step failed")
                for req in list(sched.running):
                    sched.count_done(False)
                    req.cancel()
                    req.fail(CosyVoiceError(f"synthesis failed: {type(e).__name__}"))
                continue
            if touched:
                parts.vocoder.notify()
            del touched, parts  # nothing of a finished request stays referenced while idle

    def _finished(self, req: Request, ok: bool | None) -> None:
        """Called by the vocoder thread when a request delivered its last chunk (ok), failed or was cancelled
        (None): its reservation goes back to the queue."""
        if ok is not None and not req.internal:
            self._sched.count_done(ok)
        self._sched.release(req)
        with self._drained:
            self._drained.notify_all()

    def _fatal(self, error: BaseException) -> None:
        """A CUDA error left the GPU context unusable (every later call fails, and some fail in destructors, which
        aborts the process): fail every request with a clear error, mark the engine dead (`/health` turns
        unhealthy) and, in a server, exit with code 70 so that a supervisor restarts it."""
        if self.fatal_error is not None:
            return
        self.fatal_error = f"the GPU failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
        log.critical("%s; failing every request%s", self.fatal_error,
                     " and exiting with code 70" if self.config.exit_on_fatal else "")
        self._closed = True
        dead = EngineDead(f"{self.fatal_error}; the server must be restarted")
        for req in self._sched.drop_waiting() + list(self._sched.running) + self._parts.vocoder.requests():
            req.cancel()
            req.fail(dead)
        self._sched.poke()
        if self.config.exit_on_fatal:
            # a moment for the HTTP layer to send those errors, then exit without running CUDA destructors
            threading.Timer(1.0, os._exit, args=(70,)).start()

    # ---- requests ------------------------------------------------------------------------------------------
    def stream(self, request: SynthesisRequest) -> Iterator[AudioChunk]:
        """Validate and prepare now (InputError here, before any chunk), then yield chunks as they are made.
        Closing the iterator cancels the request; its KV slot is freed at the next step."""
        if self.fatal_error is not None:
            raise EngineDead(f"{self.fatal_error}; the server must be restarted")
        if self._closed:
            raise CosyVoiceError("the engine is closed")
        return self._submit(self._prepare(request))

    def synthesize(self, request: SynthesisRequest) -> AudioChunk:
        """The whole clip as one chunk."""
        return next(iter(self.stream(dataclasses.replace(request, stream=False))))

    def _submit(self, req: Request) -> Iterator[AudioChunk]:
        """Queue `req` (the vocoder gets it when it is admitted); `EngineBusy` when it certainly cannot start in
        time."""
        self._sched.submit(req)
        return self._results(req)

    def _results(self, req: Request) -> Iterator[AudioChunk]:
        try:
            while True:
                item = req.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.is_last:
                    return
        finally:
            if not req.finished:
                req.cancel()
                self._sched.poke()
                self._parts.vocoder.notify()

    def _prepare(self, r: SynthesisRequest) -> Request:
        arrival = time.perf_counter()
        mode = check_request(r)
        if not isinstance(r.text, str):
            return self._prepare_streamed_text(r, mode, arrival)
        texts = split_text(r.text, self.tokenizer.encode, family=self.tokenizer.family)  # before any audio work
        features, prompt, prompt_text = self._flow_prompt(r, mode)
        speech = prompt.tokens[0] if mode == Mode.ZERO_SHOT else None  # shares the pinned copy
        llm = self._parts.model.llm
        pieces = []
        for text in texts:
            ids, n_text = build_text_inputs(mode, self.tokenizer, text, prompt_text, r.instruct_text)
            min_len, max_len = llm.length_bounds(n_text)
            max_len = min(max_len, r.max_tokens or max_len, r.force_tokens or max_len)
            if r.force_tokens:
                max_len = r.force_tokens
            piece = TextPiece(self._host(torch.tensor(ids, dtype=torch.long)), speech, min_len, max_len)
            room = MAX_SEQ[self.device.type] - piece.prefix_len - 1
            if room < max(min_len, 1) or (r.force_tokens and room < r.force_tokens):
                raise InputError("a sentence of the text (with the prompt) is too long; split it with punctuation "
                                 "or use a shorter prompt")
            piece.max_len = min(max_len, room)
            pieces.append(piece)
        req = Request(pieces, prompt, stream=r.stream, speed=float(r.speed), seed=r.seed,
                      force_tokens=r.force_tokens, arrival=arrival, frontend_s=time.perf_counter() - arrival,
                      warnings=features.warnings)
        req.pages = self._parts.vocoder.pages_needed(req)
        if req.pages > self._sched.admission.pages:
            raise InputError("the text (with the prompt) is too long for this server's flow memory; use a shorter "
                             "prompt or text, or split the text with punctuation")
        return req

    def _flow_prompt(self, r: SynthesisRequest, mode: Mode) -> tuple[PromptFeatures | PendingFeatures, FlowPrompt, str]:
        """(prompt features, flow prompt on the host, prompt text) of a request. A new voice's mel and speaker
        embedding may still be in the making: the flow prompt then holds them as futures, which the vocoder takes when
        they are done."""
        features, prompt_text = self._prompt_features(r, mode)
        tokens, mel = features.speech_tokens, features.mel
        if mode == Mode.SFT:
            tokens = torch.zeros(1, 0, dtype=torch.int32)
            mel = torch.zeros(1, 0, self._parts.model.config.flow.output_size)

        def host(t: torch.Tensor | Future) -> torch.Tensor | Future:
            return self._host(t) if isinstance(t, torch.Tensor) else then(t, self._host)

        return features, FlowPrompt(self._host(tokens), host(mel), host(features.embedding)), prompt_text

    def _prepare_streamed_text(self, r: SynthesisRequest, mode: Mode, arrival: float) -> Request:
        """A request whose text arrives while its speech is made (upstream's `inference_bistream`): one piece that
        the LLM decodes in cycles as text comes (see engine/bistream.py). Its flow reservation starts with room for
        `ROOM_FIRST_TOKENS` speech tokens and grows as its speech does, up to the longest piece a slot can hold (see
        `Admission`)."""
        if not r.stream:
            raise InputError("streamed text needs streamed audio (stream=True)")
        if r.max_tokens is not None:
            raise InputError("max_tokens applies to a whole text, not to streamed text")
        if not isinstance(r.text, TextStream | Iterable):
            raise InputError(f"text must be a string or an iterable of strings, got {type(r.text).__name__}")
        features, prompt, prompt_text = self._flow_prompt(r, mode)
        ids = prompt_ids(mode, self.tokenizer, prompt_text, r.instruct_text)
        speech = prompt.tokens[0] if mode == Mode.ZERO_SHOT else None
        max_seq = MAX_SEQ[self.device.type]
        n_prompt = 0 if speech is None else speech.numel()
        if len(ids) + n_prompt + MIN_ROOM > max_seq:
            raise InputError("the prompt is too long to stream text after it; use a shorter prompt")
        plan = BistreamPlan(self._parts.model.llm.cfg, ids, [] if speech is None else speech.tolist(),
                            self.config.bistream_fixes)
        piece = TextPiece(self._host(torch.tensor(ids, dtype=torch.long)), speech, 0, max_seq - n_prompt - 2)
        source = r.text if isinstance(r.text, TextStream) else None
        req = Request([piece], prompt, stream=True, speed=1.0, seed=r.seed, force_tokens=r.force_tokens,
                      arrival=arrival, frontend_s=time.perf_counter() - arrival, warnings=features.warnings)
        if source is None:
            source = TextStream.pump(r.text, stop=lambda: req.cancelled or req.finished)
        req.feed = BistreamFeed(plan, source, self.tokenizer.encode, self.config.text_idle_timeout, r.force_tokens)
        source.listen(lambda: self._text_arrived(req))
        req.token_room = min(piece.max_len, ROOM_FIRST_TOKENS)  # grows as the speech does (see `Admission`)
        req.pages = self._parts.vocoder.pages_needed(req, req.token_room)
        if req.pages > self._sched.admission.pages:
            raise InputError("streamed text needs more flow memory than this server has")
        return req

    def _text_arrived(self, req: Request) -> None:
        """A streamed-text request's text grew or ended (the engine thread takes it at its next step), or its
        producer went away: then the request is cancelled as when its consumer closes the iterator."""
        if req.feed is not None and req.feed.source.aborted and not req.finished:
            req.cancel()
            req.fail(CosyVoiceError("the text stream was aborted"))
            self._parts.vocoder.notify()
        self._sched.poke()

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """A request's tensor as `_prepare` hands it over: on the CPU (`_prepare` does no device work), pinned on
        CUDA so that the threads that copy it to the device do not wait for the GPU."""
        return t.pin_memory() if self.device.type == "cuda" else t

    def _prompt_features(self, r: SynthesisRequest, mode: Mode) -> tuple[PromptFeatures | PendingFeatures, str]:
        """(prompt features, prompt text) from a saved voice, an SFT speaker or the prompt audio (a new one's mel and
        speaker embedding still in the making)."""
        mel_bins = self._parts.model.config.flow.output_size
        if r.voice:
            if r.voice in self._spk2info:
                emb = self._spk2info[r.voice]["embedding"].reshape(1, -1).float()
                return PromptFeatures(torch.zeros(1, 0, dtype=torch.int32), emb, torch.zeros(1, 0, mel_bins)), ""
            builtin = self.voices.builtin(r.voice)
            if builtin is not None:  # read-only: its features are computed on first use and kept by the prompt cache
                return self.prompt_features(str(builtin.audio)), builtin.prompt_text
            saved = self.voices.load(r.voice)
            return self.voice_features(saved), saved.meta.get("prompt_text", "")
        return self._prompt(r.prompt_audio, wait=False)[1], r.prompt_text

    def voice_features(self, voice: SavedVoice) -> PromptFeatures:
        """A saved voice's features for this model: the stored ones when it was saved with this family, else
        extracted with this model's frontend from its stored prompt audio (as a fresh save here would: the same
        path and the same prompt cache, so only the first use pays). The voice's file stays as it is, so it keeps
        serving both families. A voice of the other family without audio (format versions 1 and 2) is refused:
        speech tokens of one family's tokenizer mean nothing to the other's LLM and flow."""
        here = self.family.family
        if voice.family == here:
            return voice.features
        made, this = family_name(voice.family), family_name(here)
        if voice.audio is None:
            raise InputError(f"Saved voice {voice.name!r} was made with a {made} model (its speech tokens are "
                             f"{made}'s) and holds no prompt audio, so it cannot speak with this {this} model; save "
                             "it again from its audio with this model, under this or another name. A voice saved "
                             "again keeps its prompt audio and speaks with either family.")
        log.debug("saved voice %r: extracting %s features from its %s prompt audio", voice.name, this, made)
        features = self.prompt_features((voice.audio.sample_rate, voice.audio.wav[0].numpy()))
        return dataclasses.replace(features, warnings=())  # as the stored features: the save showed them

    def prompt_features(self, source) -> PromptFeatures:
        """Speech tokens, speaker embedding and mel of prompt audio, cached by its decoded content.

        A repeated prompt costs one decode and one hash: validation, silence trimming and both ONNX models
        run only on a miss.
        """
        return self._prompt(source)[1]

    def _prompt(self, source, wait: bool = True) -> tuple[PromptAudio, PromptFeatures | PendingFeatures]:
        """(the prompt as the frontend reads it: mono, untrimmed, at its own rate; its features). With `wait=False` a
        new prompt's features come as soon as its speech tokens are made, its mel and speaker embedding still in the
        making (`PendingFeatures`); the prompt cache gets them when they are made."""
        wav, rate = decode_audio(source)
        mono = PromptAudio(torch.from_numpy(wav).mean(dim=0, keepdim=True), rate)
        key = prompt_key(mono)
        cached = self.prompt_cache.get(key)
        if cached is not None:
            return mono, cached
        warnings = tuple(validate(wav, rate))
        pending = start_prompt_features(trim_silence(mono), self.speech_tokenizer, self.speaker_encoder,
                                        self._parts.model.config.feat, warnings)
        if wait:
            return mono, self.prompt_cache.put(key, pending.result())
        pending.when_made(lambda features: self.prompt_cache.put(key, features))
        return mono, pending

    # ---- settings ------------------------------------------------------------------------------------------
    def set_max_queue_wait(self, seconds: float) -> None:
        """How long a request may wait for room before it is refused as busy (live)."""
        check_queue_wait(seconds)
        self.config.max_queue_wait = float(seconds)
        self._sched.set_max_queue_wait(float(seconds))

    def set_max_batch_size(self, n: int) -> None:
        if not isinstance(n, int) or n < 1:
            raise InputError(f"max batch size must be a positive integer, got {n!r}")
        self.config.max_batch_size = n
        runner = self._parts.runner
        if n > runner.num_slots:
            def grow() -> None:
                parts = self._parts
                slots = self._slots_for(n - parts.runner.num_slots, parts.model, parts.policy)
                parts.runner.resize(parts.runner.num_slots + slots)
                pool = parts.vocoder.flow_runner.pool
                parts.vocoder.grow(*self._flow_room(parts.runner.num_slots, pool.num_pages, parts.model,
                                                    parts.policy), self._sched.resize_admission)

            self._control.put(grow)
        self._sched.set_max_batch_size(n)
        self._sched.poke()

    def set_precision(self, precision: str) -> None:
        """Stop admitting, let running requests finish, rebuild in the new precision; on failure keep the old."""
        validate_precision(precision)
        with self._switch_lock:
            self._sched.paused = True
            self._sched.poke()
            with self._drained:
                self._drained.wait_for(lambda: self._sched.idle() and self._parts.vocoder.idle())
            old = self._parts
            try:
                parts = self._build(precision)
            except Exception as e:
                self._sched.paused = False
                self._sched.poke()
                log.exception("precision switch to %s failed", precision)
                raise CosyVoiceError(f"could not switch to {precision}: {type(e).__name__}; kept "
                                     f"{old.policy.name}") from e
            old.vocoder.stop()
            self._parts = parts
            self.config.precision = precision
            del old
            gc.collect()  # the old model and pools are unreachable now: free them before the new pool grows
            voc = parts.vocoder
            # no thread uses the new pool yet: grown here, before admissions
            voc.flow_runner.grow(*self._flow_room(parts.runner.num_slots, voc.flow_runner.pool.num_pages, parts.model,
                                                  parts.policy))
            self._sched.resize_admission(voc.flow_runner.pool.num_pages, voc.max_streams)
            voc.capture_graphs()
            voc.start(self._finished, self._sched.poke, self._fatal)
            log.info("precision switched to %s", precision)
            self._sched.paused = False
            self._sched.poke()

    # ---- voices --------------------------------------------------------------------------------------------
    def save_voice(self, name: str, prompt_audio, prompt_text: str, overwrite: bool = True) -> None:
        """Save a prompt's features and its audio under `name` (the audio lets a model of the other family use the
        voice, see `voice_features`); `overwrite=False` refuses a name already saved (`VoiceExists`). Built-in
        voices are read-only (`ReadOnlyVoice`)."""
        self.voices.check_writable(name, overwrite)  # before the prompt's features are computed
        audio, features = self._prompt(prompt_audio)
        self._check_prompt_room(prompt_text, features)
        self.voices.save(name, features, {"prompt_text": prompt_text}, overwrite, audio=audio)

    def _check_prompt_room(self, prompt_text: str, features: PromptFeatures) -> None:
        """A voice is saved only if a request can use it: its transcript passes a request's text checks, and with
        the prompt's speech tokens leaves room in one KV slot for text and speech (as a streamed text needs)."""
        if not prompt_text.strip():  # no transcript: a cross-lingual voice, whose prompt the LLM does not read
            return
        used = len(prompt_ids(Mode.ZERO_SHOT, self.tokenizer, prompt_text)) + features.speech_tokens.shape[-1]
        max_seq = MAX_SEQ[self.device.type]
        if used + MIN_ROOM > max_seq:
            raise PromptTooLong(f"the prompt is too long: its transcript and audio take {used} of the {max_seq} "
                             "positions one request has, leaving no room for text; use a shorter prompt")

    def delete_voice(self, name: str) -> None:
        self.voices.delete(name)

    def list_voices(self) -> list[str]:
        """Built-in and saved voice names, sorted."""
        return self.voices.names()

    # ---- status --------------------------------------------------------------------------------------------
    @property
    def family(self) -> ModelFamily:
        """What differs for the served model's family (`engine/family.py`)."""
        return self._parts.family

    @property
    def info(self) -> dict:
        parts = self._parts
        model = parts.model
        size = "tiny" if model.config.llm.qwen2.num_layers < 24 else "full"
        named = "" if parts.family.family == Family.COSYVOICE2 else f"{parts.family.family.value} "
        return {
            "model": f"random {named}{size}" if model.is_random else str(model.model_dir),
            "is_random": model.is_random,
            "family": parts.family.family.value,  # cosyvoice2 | cosyvoice3
            "family_name": parts.family.name,  # CosyVoice2 | CosyVoice3
            "precision": parts.policy.name,
            "device": str(self.device),
            "speech_tokenizer": self.speech_tokenizer.runs_on,  # where a new voice's speech tokens are made
            "max_batch_size": self._sched.max_batch_size,
            "max_queue_wait": self._sched.admission.max_queue_wait,
            "startup_s": {k: round(v, 2) for k, v in self.startup_s.items()},
            "sample_rate": self.sample_rate,
            "speakers": sorted(self._spk2info),
        }

    def stats(self) -> dict:
        flow = self._parts.vocoder.flow_runner
        load = self._parts.vocoder.load(time.perf_counter())  # what admission weighs (see engine/admission.py)
        return {**self._sched.stats(), "vocoder_round_s": load.round_s, "streams_starting": load.starting,
                "fp32_fallbacks": self.fallbacks.count,
                "flow_graph_captures": flow.graphs.captures,
                "hift_graph_captures": self._parts.vocoder.hift_graphs.graphs.captures,
                "flow_graph_misses": flow.graphs.misses,
                "hift_graph_misses": self._parts.vocoder.hift_graphs.graphs.misses,
                "flow_prefix_hits": flow.prefix_hits,
                **self._stage_counters(),
                "flow_pages": flow.pool.num_pages, "flow_pages_used": flow.pool.num_pages - len(flow.pool.free_pages)}

    def _stage_counters(self) -> dict:
        """Where the engine's two threads spend their time, since start: the LLM's steps (decode rows in them) and
        the vocoder's rounds (chunks in them, paged flow calls and their rows, prompt-prefix calls among them, and
        prompt prefixes that rode along with chunks). Their
        rates over a window say which thread bounds the throughput (docs/benchmarks.md reads them)."""
        sched, voc = self._sched, self.vocoder_counters
        return {"llm_steps": sched.steps, "llm_rows": sched.step_rows, "llm_busy_seconds": sched.busy_s,
                "vocoder_rounds": voc.rounds, "vocoder_chunks": voc.chunks, "vocoder_busy_seconds": voc.busy_s,
                "flow_calls": voc.flow_calls, "flow_rows": voc.flow_rows, "flow_prefix_calls": voc.prefix_calls,
                "flow_prefix_rides": voc.prefix_rides}

    def close(self) -> None:
        if self._shut:
            return
        self._shut = self._closed = True
        self._sched.poke()
        self._thread.join()
        for req in self._sched.drop_waiting() + list(self._sched.running):
            req.fail(CosyVoiceError("the engine was closed"))
        self._parts.vocoder.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
