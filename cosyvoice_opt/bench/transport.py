"""How the serving benchmark reaches the engine: in-process calls or the HTTP API, with the same workload.

In-process, a request is `engine.stream(SynthesisRequest(...))` with the voice's prompt audio (so the frontend
computes its features, as for a new speaker) and its forced token count. Over HTTP, a request is
`POST /v1/audio/speech` streaming raw 16-bit pcm to a voice saved beforehand through `POST /v1/voices` (the API
takes no prompt audio per request, so its first packet holds no frontend). A server on random weights takes the same
forced token count (`force_tokens`, the API's benchmark extension), so both transports run the same lengths; a real
model's server refuses it, and there the output length follows the text's length (the workload's text grows with
the requested audio length) and the model's end of speech.

A streamed-text (bistream) request, in-process only, feeds its text through a `TextStream` one token of the
engine's tokenizer at a time at a given rate, as a voice agent's LLM emits it; its length then follows the text
(the engine forces no token count on streamed text). The benchmark does not drive the WebSocket.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np

from cosyvoice_opt.bench.load import Run, closed_loop, open_loop
from cosyvoice_opt.bench.report import FAILED, OK, REJECTED, Delivery, TextTimes
from cosyvoice_opt.bench.workload import RequestSpec, Workload, poisson_arrivals, wav_bytes
from cosyvoice_opt.errors import EngineBusy
from cosyvoice_opt.limits import MAX_SEED
from cosyvoice_opt.server.model_names import OPENAI_MODELS
from cosyvoice_opt.types import Mode, SynthesisRequest, TextStream

MODEL = OPENAI_MODELS[0]  # the name the benchmarks' HTTP requests send: every server answers to it, of either family

REQUEST_TIMEOUT_S = 300.0
VOICE_UPLOADS = 8  # voices saved at once before a run


def token_pieces(tokenizer, text: str) -> list[str]:
    """`text` as an LLM streams it: one piece per token of `tokenizer` (a token that ends inside a character is held
    until the character is whole)."""
    pieces, ids, said = [], [], ""
    for token in tokenizer.encode(text):
        ids.append(token)
        decoded = tokenizer.decode(ids)
        if not decoded.endswith("\ufffd"):
            pieces.append(decoded[len(said):])
            said = decoded
    return pieces


@dataclass
class StreamedText:
    """A prepared streamed-text request: its text as pieces, pushed at `rate` per second from the call."""

    request: SynthesisRequest
    pieces: list[str]
    rate: float


class InProcessTransport:
    """Threads of this process call the engine."""

    lengths = "forced"

    def __init__(self, engine) -> None:
        self.engine = engine

    def prepare(self, spec: RequestSpec, text_rate: float | None = None) -> SynthesisRequest | StreamedText:
        """The request with its prompt as 16-bit PCM (as the WebUI hands it over; half the memory of floats while a
        whole run's requests wait prepared). With `text_rate`, its text streams in at that many tokens per second."""
        rate, wave = spec.voice.audio()
        pcm = np.round(np.clip(wave, -1.0, 1.0) * 32767).astype(np.int16)
        request = SynthesisRequest(text=spec.text, mode=Mode.ZERO_SHOT, prompt_audio=(rate, pcm),
                                   prompt_text=spec.voice.prompt_text, stream=True, seed=spec.index % MAX_SEED,
                                   force_tokens=spec.tokens)
        if text_rate is None:
            return request
        return StreamedText(request, token_pieces(self.engine.tokenizer, spec.text), text_rate)

    def send(self, prepared: SynthesisRequest | StreamedText) -> Delivery:
        if isinstance(prepared, StreamedText):
            return self._send_streamed(prepared)
        return self._deliver(prepared, time.perf_counter())

    def _send_streamed(self, prepared: StreamedText) -> Delivery:
        """The text starts to arrive at the call, as the agent's LLM starts with its TTS request; it stops with the
        request (a refused or failed one stops its feeder too)."""
        t0, m0, ended = time.perf_counter(), time.monotonic(), threading.Event()
        source = TextStream.pump(prepared.pieces, stop=ended.is_set, rate=prepared.rate)
        try:
            delivery = self._deliver(dataclasses.replace(prepared.request, text=source), t0)
        finally:
            ended.set()

        def since_call(at: float | None) -> float | None:
            return None if at is None else at - m0

        delivery.text = TextTimes(len(source.push_times), since_call(source.unlocked_at),
                                  since_call(source.closed_at), since_call(source.first_audio_text_at))
        return delivery

    def _deliver(self, request: SynthesisRequest, t0: float) -> Delivery:
        delivery = Delivery(OK)
        try:
            for chunk in self.engine.stream(request):
                delivery.arrivals.append((time.perf_counter() - t0, chunk.duration))
                if delivery.frontend is None:
                    delivery.frontend = chunk.timings.frontend
        except EngineBusy as e:  # at the call or at the first chunk: refused, not served
            delivery.status, delivery.error = REJECTED, f"EngineBusy: {e}"
            delivery.refused = time.perf_counter() - t0
        except Exception as e:  # counted and reported; the run goes on
            delivery.status, delivery.error = FAILED, f"{type(e).__name__}: {e}"
        return delivery

    def stats(self) -> dict | None:
        return self.engine.stats()


def health(client: httpx.Client) -> dict:
    """`GET /health`: the server's engine info, and its counters under "stats"."""
    r = client.get("/health")
    r.raise_for_status()
    return r.json()


def http_lengths(info: dict) -> str:
    """How a server of `info` (`GET /health`) sets lengths: "forced" on random weights (it takes `force_tokens`),
    else "text"."""
    return "forced" if info.get("is_random") else "text"


class HttpTransport:
    """An HTTP client of the API at `url` (one connection pool, unbounded, shared by the request threads); it forces
    each request's token count where the server takes it (`http_lengths`)."""

    def __init__(self, url: str, headers: dict | None = None) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        self.client = httpx.Client(base_url=url, headers=headers or {}, timeout=REQUEST_TIMEOUT_S, limits=limits)
        info = self._health()
        self.sample_rate = int(info.get("sample_rate", 24000))
        self.lengths = http_lengths(info)
        self._saved: set[str] = set()

    def _health(self) -> dict:
        return health(self.client)

    def save_voices(self, specs: Iterable[RequestSpec]) -> None:
        """Save the voices of `specs` that are not saved yet, a few uploads at a time."""
        voices = {s.voice.name: s.voice for s in specs if s.voice.name not in self._saved}
        with ThreadPoolExecutor(VOICE_UPLOADS) as pool:
            list(pool.map(self._save, voices.values()))

    def _save(self, voice) -> None:
        r = self.client.post("/v1/voices", data={"name": voice.name, "prompt_text": voice.prompt_text},
                             files={"file": ("prompt.wav", wav_bytes(*voice.audio()), "audio/wav")})
        if r.status_code != 201:
            raise RuntimeError(f"could not save voice {voice.name}: HTTP {r.status_code}: {r.text[:200]}")
        self._saved.add(voice.name)

    def delete_voices(self) -> None:
        for name in sorted(self._saved):
            try:
                self.client.delete(f"/v1/voices/{name}")
            except httpx.HTTPError:  # best effort: a server that went away keeps its voices
                return
        self._saved.clear()

    def prepare(self, spec: RequestSpec, text_rate: float | None = None) -> dict:
        if text_rate is not None:
            raise NotImplementedError("streamed text is benchmarked in-process only (not over the WebSocket)")
        if spec.voice.name not in self._saved:
            self._save(spec.voice)
        body = {"model": MODEL, "input": spec.text, "voice": spec.voice.name, "seed": spec.index % MAX_SEED,
                "response_format": "pcm", "stream_format": "audio"}
        if self.lengths == "forced":
            body["force_tokens"] = spec.tokens
        return body

    def send(self, prepared: dict) -> Delivery:
        t0 = time.perf_counter()
        delivery = Delivery(OK)
        try:
            with self.client.stream("POST", "/v1/audio/speech", json=prepared) as r:
                if r.status_code != 200:
                    r.read()
                    busy = r.status_code == 503
                    delivery.status = REJECTED if busy else FAILED
                    delivery.refused = time.perf_counter() - t0 if busy else None
                    retry = f" (Retry-After {r.headers.get('retry-after')})" if busy else ""
                    delivery.error = f"HTTP {r.status_code}{retry}: {r.text[:200]}"
                    return delivery
                odd = b""  # a byte of a sample split between two network reads
                for part in r.iter_bytes():
                    data, odd = odd + part, b""
                    if len(data) % 2:
                        data, odd = data[:-1], data[-1:]
                    if data:
                        delivery.arrivals.append((time.perf_counter() - t0, len(data) / 2 / self.sample_rate))
        except Exception as e:  # connection or read failure
            delivery.status, delivery.error = FAILED, f"{type(e).__name__}: {e}"
            return delivery
        if not delivery.arrivals:
            delivery.status, delivery.error = FAILED, "no audio in a 200 response"
        return delivery

    def stats(self) -> dict | None:
        """The engine's counters from `GET /health` (its "stats"); None if absent or unreachable."""
        try:
            return self._health().get("stats")
        except (httpx.HTTPError, ValueError):
            return None

    def close(self) -> None:
        self.delete_voices()
        self.client.close()


def http_load(url: str, headers: dict, kind: str, value: float, workload: Workload, duration: float, warmup: float,
              first_index: int, seed: int) -> Run:
    """One load over the API at `url` (a client process's job): "rate" (open loop; every voice of the schedule is
    saved before it starts) or "clients" (closed loop; a client saves its next voice before sending). The voices are
    deleted afterwards."""
    transport = HttpTransport(url, headers)
    try:
        if kind == "rate":
            count = len(poisson_arrivals(value, warmup + duration, seed))
            transport.save_voices(workload.request(first_index + k) for k in range(count))
            return open_loop(transport, workload, value, duration, warmup, first_index, seed)
        return closed_loop(transport, workload, int(value), duration, warmup, first_index)
    finally:
        transport.close()
