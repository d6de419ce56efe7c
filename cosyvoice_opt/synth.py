"""`python -m cosyvoice_opt synth`: one request from the command line to an audio file (wav, mp3, opus, flac or raw
pcm, chosen by the output file's extension)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from .audio_formats import FORMATS, encode_clip, format_for_path
from .config import COSYVOICE2, FAMILIES
from .engine import Engine, EngineConfig, check_request
from .errors import CosyVoiceError, InputError
from .frontend.audio import decode_audio, validate
from .limits import MAX_PROMPT_SECONDS, MAX_SEED, MIN_PROMPT_SAMPLE_RATE, MIN_PROMPT_SECONDS, SPEED_RANGE
from .types import Mode, SynthesisRequest


def check_output(path: str) -> str:
    """The output's format, refusing (InputError) an unknown extension, a folder that does not exist, a folder in
    the file's place or a file that cannot be created, so a run never synthesises audio it cannot write. The file is
    opened to append (an existing file is left as it is) and removed again if the probe created it."""
    fmt = format_for_path(path)
    target = Path(path)
    folder = target.parent
    if not folder.is_dir():
        raise InputError(f"Output folder {str(folder)!r} does not exist; create it or write elsewhere.")
    if target.is_dir():
        raise InputError(f"Output file {path!r} is a folder; name a file, e.g. {str(target / ('out.' + fmt))!r}.")
    existed = target.exists()
    try:
        with target.open("ab"):
            pass
    except OSError as e:
        raise InputError(f"Output file {path!r} cannot be written ({e.strerror}); write elsewhere.") from None
    if not existed:
        target.unlink(missing_ok=True)
    return fmt


def main(argv: list[str] | None = None, prog: str = "python -m cosyvoice_opt synth") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--text", required=True, help="text to speak")
    p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.ZERO_SHOT.value)
    p.add_argument("--prompt-audio", help=f"prompt voice (wav/flac/ogg/mp3, {MIN_PROMPT_SECONDS:g}-"
                                          f"{MAX_PROMPT_SECONDS:g} s, >= {MIN_PROMPT_SAMPLE_RATE // 1000} kHz)")
    p.add_argument("--prompt-text", default="", help="transcript of the prompt audio (zero_shot)")
    p.add_argument("--instruct", default="", help="instruction (instruct2), e.g. 'Speak happily.'")
    p.add_argument("--voice", help="a built-in or saved voice name instead of --prompt-audio")
    p.add_argument("-o", "--output", default="out.wav",
                   help=f"output file; its extension picks the format: {', '.join('.' + f for f in FORMATS)}")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model-dir")
    which.add_argument("--random", choices=["tiny", "full"], help="use a seeded random-weight model")
    p.add_argument("--family", choices=FAMILIES, default=COSYVOICE2, help="family of the --random model")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    p.add_argument("--speed", type=float, default=1.0, help=f"{SPEED_RANGE[0]} to {SPEED_RANGE[1]}, without --stream")
    p.add_argument("--seed", type=int, default=0, help=f"0 to {MAX_SEED}")
    p.add_argument("--stream", action="store_true", help="stream chunks (prints first-packet latency)")
    p.add_argument("--voices-dir", default="voices")
    args = p.parse_args(argv)
    request = SynthesisRequest(
        text=args.text, mode=Mode(args.mode), prompt_audio=args.prompt_audio, prompt_text=args.prompt_text,
        instruct_text=args.instruct, voice=args.voice, stream=args.stream, speed=args.speed, seed=args.seed,
    )
    try:  # everything that can be refused is refused before the model loads
        fmt = check_output(args.output)
        check_request(request)
        if args.prompt_audio and not args.voice:
            validate(*decode_audio(args.prompt_audio))
        engine = Engine.from_model_dir(
            args.model_dir,
            EngineConfig(precision=args.precision, random_size=args.random, family=args.family,
                         voices_dir=args.voices_dir,
                         max_batch_size=1, warmup=False),
        )
        try:
            t0 = time.perf_counter()
            chunks, first = [], None
            for chunk in engine.stream(request):
                first = first if first is not None else time.perf_counter() - t0
                for warning in chunk.warnings:
                    print(f"warning: {warning}", file=sys.stderr)
                chunks.append(chunk.pcm)
            elapsed = time.perf_counter() - t0
            sr = engine.info["sample_rate"]
        finally:
            engine.close()
    except CosyVoiceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    pcm = np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
    try:
        Path(args.output).write_bytes(encode_clip(pcm, sr, fmt))
    except OSError as e:  # the output changed since it was checked
        print(f"error: Output file {args.output!r} cannot be written ({e.strerror}).", file=sys.stderr)
        return 1
    seconds = len(pcm) / sr
    print(f"wrote {args.output} ({fmt}): {seconds:.2f} s of audio in {elapsed:.2f} s "
          f"(first packet {first or 0:.3f} s, RTF {elapsed / max(seconds, 1e-9):.3f}, {len(chunks)} chunk(s))")
    return 0
