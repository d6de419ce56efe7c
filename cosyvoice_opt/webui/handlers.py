"""What the WebUI's generation and voice events do: UI values in, engine calls, page updates out.

Engine errors reach the page as one line (gr.Error without a traceback); a refusal because the engine is at capacity
says when to try again instead of reading as a failure. Each tab checks its own fields first and names them as the
tab shows them; on the page (`on_page`) an error is written in the tab's status line, where the user looks, while
API callers get it as the endpoint's error.
"""

import contextlib
import functools
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import gradio as gr
import numpy as np

from cosyvoice_opt.errors import CosyVoiceError, EngineBusy
from cosyvoice_opt.frontend.audio import decode_audio, validate
from cosyvoice_opt.frontend.text_normalize import clean_text
from cosyvoice_opt.frontend.text_split import has_speakable
from cosyvoice_opt.frontend.voices import VoiceExists
from cosyvoice_opt.limits import LIVE_WORDS_PER_S_RANGE
from cosyvoice_opt.server.metrics import CLIENT_CLOSED, count_ui_request, ui_status
from cosyvoice_opt.types import AudioChunk, Mode, SynthesisRequest, TextStream

log = logging.getLogger("cosyvoice_opt.webui")

T = TypeVar("T")
Outputs = tuple[Any, Any, Any]  # (streamed chunk, full clip, metrics)

SPEED_WHILE_STREAMING = "Speed works only without streaming: set Speed to 1.0, or turn Stream off."
NO_PROMPT = "Add a prompt voice: upload or record a clip of the speaker above{alternative}."
NO_TRANSCRIPT = ("Write the transcript of the prompt audio (the words spoken in it); the Cross-lingual tab clones a "
                 "voice without one.")
NO_INSTRUCTION = 'Write an instruction, e.g. "Speak happily." or "Speak slowly, in a calm voice."'
REPLACE_LABEL = "Replace a saved voice of this name"


def busy_message(error: EngineBusy) -> str:
    """The line a refused request shows: when to try again, in whole seconds (at least 1)."""
    return f"The server is busy; try again in {max(1, math.ceil(error.retry_after))} s."


def user_error(error: CosyVoiceError) -> gr.Error:
    """A gr.Error carrying only the engine's one-line message (no traceback on the page or in the log), and the
    status the HTTP API would answer (for /metrics)."""
    if isinstance(error, EngineBusy):
        shown = gr.Error(busy_message(error), title="Server busy", print_exception=False)
    else:
        shown = gr.Error(str(error), print_exception=False)
    shown.api_status = ui_status(error)
    return shown


def counted(endpoint: str) -> Callable[[Callable[..., Iterator[Outputs]]], Callable[..., Iterator[Outputs]]]:
    """Counts each call of a generation event in /metrics beside the API's requests (client="webui"): 200 when it
    ends, 400 for a refused input, the API's status for an engine error, 499 when the page went away."""
    def decorate(event: Callable[..., Iterator[Outputs]]) -> Callable[..., Iterator[Outputs]]:
        @functools.wraps(event)
        def counted_event(self: Any, *args: Any) -> Iterator[Outputs]:
            status, code = 200, None
            try:
                yield from event(self, *args)
            except gr.Error as e:
                status, code = getattr(e, "api_status", (400, None))
                raise
            except GeneratorExit:
                status = CLIENT_CLOSED
                raise
            except BaseException:
                status, code = 500, "internal_error"
                raise
            finally:
                count_ui_request(self.engine, endpoint, status, code)

        return counted_event

    return decorate


def refuse(message: str) -> gr.Error:
    """A one-line gr.Error for a field the user has to fix (no traceback in the log)."""
    return gr.Error(message, print_exception=False)


def engine_call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Calls an engine method, turning its user-facing errors into a one-line gr.Error."""
    try:
        return fn(*args, **kwargs)
    except CosyVoiceError as e:
        raise user_error(e) from None


def on_page(handler: Callable[..., Iterator[Outputs]]) -> Callable[..., Iterator[tuple]]:
    """The page's version of a generation endpoint: its updates plus the tab's status line, which an error is
    written into (the clip and metrics of the last run stay) instead of failing the event: a failed event marks
    every output with a bare "Error" and leaves the reason in a toast that disappears."""

    @functools.wraps(handler)
    def page(*args: Any) -> Iterator[tuple]:
        yield gr.skip(), gr.skip(), gr.skip(), ""
        try:
            with contextlib.closing(handler(*args)) as updates:  # closing the page's event cancels the request
                for update in updates:
                    yield (*update, gr.skip())
        except gr.Error as e:
            yield gr.skip(), gr.skip(), gr.skip(), f"⚠️ {e.message}"

    return page


def synthesis_request(text: str | TextStream | None, mode: Mode, stream: bool | None, speed: float | None,
                      seed: float | None, **fields: Any) -> SynthesisRequest:
    """A request from UI values. Empty fields (a cleared number box, an API caller's None) take the defaults.

    Speed is a time stretch of the whole clip, which streaming cannot do: with streaming on, a speed other than 1.0
    is refused, as the HTTP API and the CLI refuse it (the page disables the control, but an API caller or a click
    racing the checkbox can still send one). Anything else goes to the engine as it came, so that its checks word
    the error."""
    seed = 0 if seed is None else seed
    if isinstance(seed, float) and seed.is_integer():  # gr.Number may deliver 3.0
        seed = int(seed)
    speed = 1.0 if speed is None else speed
    if stream and speed != 1.0:  # as the HTTP API and the CLI: streaming cannot stretch the clip
        raise refuse(SPEED_WHILE_STREAMING)
    return SynthesisRequest(text or "", mode, stream=bool(stream), speed=speed, seed=seed, **fields)


def check_prompt_fields(prompt_audio: str | None, prompt_text: str | None = None, alternative: str = "") -> None:
    """The prompt fields a cloning tab needs, named as the tab shows them (`prompt_text` None: no transcript)."""
    if not prompt_audio:
        raise refuse(NO_PROMPT.format(alternative=alternative))
    if prompt_text is not None and not prompt_text.strip():
        raise refuse(NO_TRANSCRIPT)


def _metrics(chunks: int, tokens: int, samples: int, rate: int, first: float, wall: float, batch: int) -> dict:
    audio_s = samples / rate
    return {
        "first_packet_latency_s": round(first, 3),
        "rtf": round(wall / audio_s, 3) if audio_s else None,
        "audio_s": round(audio_s, 3),
        "wall_s": round(wall, 3),
        "tokens": tokens,
        "chunks": chunks,
        "batch_size": batch,
    }


def run(engine: Any, request: SynthesisRequest) -> Iterator[Outputs]:
    """Yields (streamed int16 chunk, full clip, metrics) updates; engine errors become one-line gr.Errors."""
    start = time.perf_counter()
    pcm, first, batch, chunk, stream, metrics = [], 0.0, 1, None, None, {}
    try:
        stream = engine.stream(request) if request.stream else _whole(engine, request)
        for chunk in stream:
            if not pcm:
                first = time.perf_counter() - start
            for warning in chunk.warnings:  # prompt quality (clipping, noise): shown, not fatal
                gr.Warning(warning)
            pcm.append(chunk.pcm)
            batch = max(batch, chunk.timings.batch_size)
            metrics = _metrics(len(pcm), chunk.tokens, sum(map(len, pcm)), chunk.sample_rate, first,
                               time.perf_counter() - start, batch)
            full = (chunk.sample_rate, np.concatenate(pcm)) if chunk.is_last else gr.skip()
            yield (chunk.sample_rate, chunk.pcm), full, metrics
    except CosyVoiceError as e:  # EngineBusy included: it may come from the call or from the first chunk
        raise user_error(e) from None
    except Exception:
        log.exception("synthesis failed")
        failed = gr.Error("Synthesis failed with an internal error; the server log has the details.",
                          print_exception=False)
        failed.api_status = (500, "internal_error")
        raise failed from None
    finally:
        if stream is not None:
            stream.close()  # a closed engine stream cancels the request and frees its batch slot
    if chunk is None:
        raise gr.Error("The model produced no audio for this text.", print_exception=False)
    if not chunk.is_last:  # the full clip normally rides with the last chunk
        yield gr.skip(), (chunk.sample_rate, np.concatenate(pcm)), metrics


def live_words(text: str | None) -> list[str]:
    """`text` as a chat model's reply arrives: word by word, each with the whitespace before it. Checked whole first
    (empty, too long, nothing to speak), since the engine sees streamed text only piece by piece."""
    try:
        text = clean_text(text or "")
    except CosyVoiceError as e:
        raise user_error(e) from None
    if not has_speakable(text):
        raise gr.Error("The text has nothing to speak: write at least one word.", print_exception=False)
    return re.findall(r"\s*\S+", text)


def _whole(engine: Any, request: SynthesisRequest) -> Iterator[AudioChunk]:
    yield engine.synthesize(request)


def voice_choices(engine: Any) -> list[str]:
    """Saved voices and the model's built-in SFT speakers, for the Saved voice dropdown."""
    return sorted(set(engine.list_voices()) | set(engine.info.get("speakers") or []))


def check_prompt(prompt_audio: str | None) -> str:
    """The prompt's problems as soon as it is uploaded or recorded (not at Generate): the same decoding and checks
    the engine runs, so that a file that is not audio, too short or silent is named at once. Fatal problems are
    also raised as a toast; quality warnings (clipping, noise) only show under the player."""
    if not prompt_audio:
        return ""
    try:
        warnings = validate(*decode_audio(prompt_audio))
    except CosyVoiceError as e:
        gr.Warning(str(e))
        return f"⚠️ {e}"
    return "  \n".join(f"⚠️ {w}" for w in warnings)


class Generation:
    """The generation and voice endpoints over one engine; each method's docstring is its API description."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @counted("/zero_shot")
    def zero_shot(self, text: str, prompt_audio: str | None, prompt_text: str, stream: bool, speed: float,
                  seed: int) -> Iterator[Outputs]:
        """3 s clone: speak `text` in the voice of `prompt_audio`, whose transcript is `prompt_text`."""
        check_prompt_fields(prompt_audio, prompt_text or "", " (or use a saved one in the Saved voice tab)")
        yield from run(self.engine, synthesis_request(text, Mode.ZERO_SHOT, stream, speed, seed,
                                                      prompt_audio=prompt_audio, prompt_text=prompt_text or ""))

    @counted("/cross_lingual")
    def cross_lingual(self, text: str, prompt_audio: str | None, stream: bool, speed: float,
                      seed: int) -> Iterator[Outputs]:
        """Speak `text` (any supported language) in the voice of `prompt_audio`; no transcript needed."""
        check_prompt_fields(prompt_audio)
        yield from run(self.engine, synthesis_request(text, Mode.CROSS_LINGUAL, stream, speed, seed,
                                                      prompt_audio=prompt_audio))

    @counted("/instruct2")
    def instruct2(self, text: str, prompt_audio: str | None, instruct_text: str, stream: bool, speed: float,
                  seed: int) -> Iterator[Outputs]:
        """Speak `text` in the voice of `prompt_audio`, styled by the natural-language `instruct_text`."""
        check_prompt_fields(prompt_audio)
        if not (instruct_text or "").strip():
            raise refuse(NO_INSTRUCTION)
        yield from run(self.engine, synthesis_request(text, Mode.INSTRUCT2, stream, speed, seed,
                                                      prompt_audio=prompt_audio, instruct_text=instruct_text or ""))

    @counted("/sft")
    def sft(self, text: str, voice: str, stream: bool, speed: float, seed: int) -> Iterator[Outputs]:
        """Speak `text` with a saved voice (see /list_voices)."""
        if not voice:
            raise gr.Error("Pick a saved voice first (save one from the 3 s clone tab).", print_exception=False)
        yield from run(self.engine, synthesis_request(text, Mode.SFT, stream, speed, seed, voice=voice))

    @counted("/live_text")
    def live_text(self, text: str, prompt_audio: str | None, prompt_text: str, words_per_second: float,
                  seed: int, voice: str | None = None) -> Iterator[Outputs]:
        """3 s clone of text that arrives while it is spoken: `text` is fed word by word at `words_per_second`
        through a TextStream, standing in for a chat model's reply; the audio starts before the text ends. A saved
        `voice` (see /list_voices) replaces the prompt audio and its transcript."""
        words = live_words(text)
        voice = voice or None
        if voice is None:
            check_prompt_fields(prompt_audio, prompt_text or "", " (or pick a saved voice below)")
        rate = words_per_second if words_per_second is not None else LIVE_WORDS_PER_S_RANGE[0]
        if not LIVE_WORDS_PER_S_RANGE[0] <= rate <= LIVE_WORDS_PER_S_RANGE[1]:
            raise gr.Error(f"Words per second must be from {LIVE_WORDS_PER_S_RANGE[0]:g} to "
                           f"{LIVE_WORDS_PER_S_RANGE[1]:g}.", print_exception=False)
        ended = threading.Event()  # a refused, failed or cancelled request stops its feeder too
        source = TextStream.pump(words, stop=ended.is_set, rate=rate)
        try:
            fields = {"voice": voice} if voice else {"prompt_audio": prompt_audio, "prompt_text": prompt_text or ""}
            yield from run(self.engine, synthesis_request(source, Mode.ZERO_SHOT, True, 1.0, seed, **fields))
        finally:
            ended.set()

    def save_voice(self, name: str, prompt_audio: str | None, prompt_text: str,
                   overwrite: bool = False) -> tuple[str, gr.Dropdown]:
        """Saves the prompt audio + transcript under `name` for the Saved voice tab and /sft. A name already saved
        is refused unless `overwrite` (as the HTTP API's 409)."""
        name = (name or "").strip()
        if not name:
            raise refuse("Name the voice first: 1-64 letters, digits, spaces, '_', '.' or '-'.")
        check_prompt_fields(prompt_audio, prompt_text or "", "")
        try:
            self.engine.save_voice(name, prompt_audio, prompt_text or "", overwrite=bool(overwrite))
        except VoiceExists:
            raise refuse(f"A voice named {name!r} is already saved: tick \"{REPLACE_LABEL}\" to overwrite it, or "
                         "choose another name.") from None
        except CosyVoiceError as e:
            raise user_error(e) from None
        log.info("%s voice %r", "saved or replaced" if overwrite else "saved", name)
        return f"Saved voice **{name}**.", gr.Dropdown(choices=voice_choices(self.engine), value=name)

    def delete_voice(self, name: str) -> tuple[str, gr.Dropdown]:
        """Deletes a saved voice."""
        if not name:
            raise gr.Error("Pick a saved voice to delete.", print_exception=False)
        engine_call(self.engine.delete_voice, name)
        log.info("deleted voice %r", name)
        return f"Deleted voice **{name}**.", gr.Dropdown(choices=voice_choices(self.engine), value=None)

    def list_voices(self) -> list[str]:  # evaluated at import (no postponed annotations): gr.api reads it
        """Names of the saved voices (and any built-in SFT speakers)."""
        return voice_choices(self.engine)

    def refresh_voices(self) -> gr.Dropdown:
        """The dropdown's choices as the engine has them now (voices saved in another tab or by the API)."""
        return gr.Dropdown(choices=voice_choices(self.engine))
