"""What a request says: a /v1/audio/speech body checked against `limits` (the engine's own ranges) and turned into
an engine request, form flags, and request bodies read under a size cap."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NamedTuple

from starlette.requests import Request

from cosyvoice_opt.audio_formats import FORMATS
from cosyvoice_opt.limits import MAX_SEED, MAX_TEXT_CHARS, SPEED_RANGE
from cosyvoice_opt.server.errors import ApiError
from cosyvoice_opt.server.model_names import model_ids
from cosyvoice_opt.server.stream_encoding import STREAM_FORMATS
from cosyvoice_opt.types import Mode, SynthesisRequest, TextStream

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")
_JSON_TYPES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
               dict: "an object", type(None): "null"}


def _kind(value) -> str:
    """What a JSON value is, for an error message: "a string", "an array", ..."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _choice(value, name: str, allowed: tuple[str, ...], default: str | None) -> str | None:
    if value is None:
        return default
    if not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string, one of {', '.join(allowed)}; got {_kind(value)}.", name)
    if value not in allowed:
        raise ApiError(400, f"Unsupported {name} {value!r}; supported: {', '.join(allowed)}.", name,
                       f"unsupported_{name}")
    return value


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class SpeechParams(NamedTuple):
    text: str
    voice: str
    response_format: str
    stream_format: str | None  # None: one whole file
    speed: float
    instructions: str
    seed: int
    force_tokens: int | None = None  # an extension for benchmarks on random weights (see `parse_speech`)


def parse_speech(body, voices: list[str], speakers: list[str], aliases: list[str] = (),
                 models: list[str] | None = None, random_weights: bool = False) -> SpeechParams:
    """Validate a /v1/audio/speech body against `limits` (the engine's own ranges); ApiError names the offending
    `param`. `voices`: built-in and saved voice names; `aliases`: OpenAI's voice names for the built-in ones;
    `models`: the model names served (None: any).

    `force_tokens` (an extension) makes each piece of the text exactly that many speech tokens, as the in-process
    benchmark forces them: random weights rarely sample the end of speech, so without it every request runs to its
    maximum length over HTTP. Only a server on random weights (`random_weights`) accepts it; a real model decides
    the length of its speech."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, one of {', '.join(models or ['the served model'])}; got "
                       f"{_kind(model)}.", "model")
    if model is not None and models is not None and model not in models:
        raise ApiError(404, f"The model {model[:100]!r} does not exist; models: {', '.join(models)}.", "model",
                       "model_not_found")
    text = body.get("input")
    if text is None:
        raise ApiError(400, "'input' is required: the text to speak, as a string.", "input")
    if not isinstance(text, str):
        raise ApiError(400, f"'input' must be a string (the text to speak); got {_kind(text)}.", "input")
    if not text.strip():
        raise ApiError(400, "'input' is empty; send the text to speak as a non-empty string.", "input")
    if len(text) > MAX_TEXT_CHARS:
        raise ApiError(400, f"'input' is {len(text)} characters; the maximum is {MAX_TEXT_CHARS}.", "input")
    voice = body.get("voice")
    if isinstance(voice, dict):
        voice = voice.get("id")
    if voice is None or voice == "":
        raise ApiError(400, "'voice' is required: a voice name (GET /v1/voices lists them).", "voice")
    if not isinstance(voice, str):
        raise ApiError(400, f"'voice' must be a string (a voice name) or an object with a string 'id'; got "
                       f"{_kind(voice)}.", "voice")
    if voice not in voices and voice not in speakers and voice not in aliases:
        known = ", ".join([*voices, *speakers]) or "none"
        also = f"; OpenAI's voice names also work: {', '.join(aliases)}" if aliases else ""
        raise ApiError(400, f"Unknown voice {voice!r}; available voices: {known}{also}.", "voice", "voice_not_found")
    fmt = _choice(body.get("response_format"), "response_format", FORMATS, "mp3")
    stream_format = _choice(body.get("stream_format"), "stream_format", ("audio", "sse"), None)
    if stream_format and fmt not in STREAM_FORMATS:
        raise ApiError(400, f"response_format {fmt!r} cannot be streamed; with stream_format use one of "
                       f"{', '.join(STREAM_FORMATS)}, or omit stream_format for a whole {fmt} file.", "response_format")
    speed = body.get("speed")
    speed = 1.0 if speed is None else speed
    lo, hi = SPEED_RANGE
    if not _number(speed):
        raise ApiError(400, f"'speed' must be a number from {lo} to {hi}; got {_kind(speed)}.", "speed")
    if not lo <= speed <= hi:  # NaN fails this too
        raise ApiError(400, f"'speed' must be a number from {lo} to {hi}, got {speed!r}.", "speed")
    if stream_format and speed != 1.0:
        raise ApiError(400, "'speed' other than 1.0 needs a whole-file response; omit stream_format.", "speed")
    instructions = body.get("instructions")
    instructions = "" if instructions is None else instructions
    if not isinstance(instructions, str):
        raise ApiError(400, f"'instructions' must be a string; got {_kind(instructions)}.", "instructions")
    if len(instructions) > MAX_TEXT_CHARS:
        raise ApiError(400, f"'instructions' is {len(instructions)} characters; the maximum is {MAX_TEXT_CHARS}.",
                       "instructions")
    seed = body.get("seed")  # an extension: OpenAI has no seed
    seed = 0 if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ApiError(400, f"'seed' must be an integer from 0 to {MAX_SEED}; got {_kind(seed)}.", "seed")
    if not 0 <= seed <= MAX_SEED:
        raise ApiError(400, f"'seed' must be an integer from 0 to {MAX_SEED}, got {str(seed)[:40]}.", "seed")
    force = body.get("force_tokens")
    if force is not None:
        if not random_weights:
            raise ApiError(400, "'force_tokens' is a benchmark extension for servers on random weights; a real model "
                           "decides the length of its speech: omit it.", "force_tokens")
        if isinstance(force, bool) or not isinstance(force, int) or force < 1:
            raise ApiError(400, f"'force_tokens' must be a positive integer (speech tokens per piece of text); got "
                           f"{str(force)[:40] if isinstance(force, int) else _kind(force)}.", "force_tokens")
    return SpeechParams(text, voice, fmt, stream_format, float(speed), instructions.strip(), seed, force)


def speakers(engine) -> list[str]:
    """The model's own speakers (SFT mode), if it has any."""
    return list(engine.info.get("speakers") or [])


def synthesis_request(engine, body, text: TextStream | None = None) -> tuple[SynthesisRequest, str, str | None]:
    """(engine request, response format, stream format) for a speech body; runs in a worker thread (reads the voice
    store). With `text`, the body is a streaming start message: the text arrives later, so `input` is not looked
    for."""
    names, store = speakers(engine), engine.voices
    if text is not None and isinstance(body, dict):
        body = {**body, "input": "-", "response_format": "pcm", "stream_format": "audio"}
    p = parse_speech(body, engine.list_voices(), names, list(store.aliases), model_ids(engine.info),
                     engine.info["is_random"])
    if p.instructions:
        mode = Mode.INSTRUCT2
    elif p.voice in names:
        mode = Mode.SFT
    else:  # a clone prompt: zero-shot with its transcript, cross-lingual when it was saved without one
        mode = Mode.ZERO_SHOT if store.prompt_text(p.voice).strip() else Mode.CROSS_LINGUAL
    request = SynthesisRequest(text=p.text if text is None else text, mode=mode, voice=p.voice,
                               instruct_text=p.instructions, stream=p.stream_format is not None, speed=p.speed,
                               seed=p.seed, force_tokens=p.force_tokens)
    return request, p.response_format, p.stream_format


def parse_flag(value, name: str) -> bool:
    """A true/false form field (absent: false)."""
    if value is None:
        return False
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ApiError(400, f"'{name}' must be true or false.", name)


async def read_capped(request: Request, limit: int, too_large: ApiError | None = None) -> AsyncIterator[bytes]:
    """The request body, chunk by chunk; `too_large` (by default a 413 naming the limit) as soon as it is (or says it
    will be) larger than `limit` bytes, so an oversized upload is never buffered."""
    if too_large is None:
        too_large = ApiError(413, f"The request body is larger than {limit / 2**20:.0f} MiB.", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise too_large
        yield chunk
