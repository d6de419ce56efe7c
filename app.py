"""Gradio WebUI for cosyvoice-opt: layout and event wiring only; all work happens in the engine.

    python app.py [--model-dir D] [--port 7860] [--host 127.0.0.1] [--share] [--precision auto|fp32|fp16|bf16]
                  [--max-batch-size N] [--concurrency N] [--auth user:pass|FILE] [--random tiny|full] [--voices-dir D]
                  [--api-key KEY] [--max-file-size MIB]

Every mode has a named endpoint (`/zero_shot`, `/cross_lingual`, `/instruct2`, `/sft`, `/save_voice`,
`/delete_voice`, `/list_voices`, `/set_precision`, `/set_max_batch_size`) for gradio_client users. Generation
events share one queue group of `--concurrency` slots; the engine batches whatever runs at once.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import gradio as gr
import numpy as np

from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.errors import CosyVoiceError
from cosyvoice_opt.monitor import Monitor
from cosyvoice_opt.server import mount_api
from cosyvoice_opt.types import Mode, SynthesisRequest

log = logging.getLogger("cosyvoice_opt.app")

ASSETS = Path(__file__).resolve().parent / "assets"
PRECISIONS = ["fp32", "fp16", "bf16"]
MAX_SEED = 2**31 - 1
WEIGHTS_HELP = (
    "Download CosyVoice2-0.5B from ModelScope (`iic/CosyVoice2-0.5B`) or Hugging Face "
    "(`FunAudioLLM/CosyVoice2-0.5B`), then pass `--model-dir DIR` or set `COSYVOICE_MODEL_DIR`."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="CosyVoice2 WebUI (cosyvoice-opt)")
    p.add_argument("--model-dir", default=None, help="CosyVoice2-0.5B folder (default: COSYVOICE_MODEL_DIR, "
                   "pretrained_models/CosyVoice2-0.5B, else a random-weight model)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--host", default="0.0.0.0", help="interface to serve on (0.0.0.0 = every interface; "
                   "127.0.0.1 = this machine only)")
    p.add_argument("--share", action="store_true", help="also create a public gradio.live link")
    p.add_argument("--precision", default="auto", choices=["auto", *PRECISIONS])
    p.add_argument("--max-batch-size", type=int, default=64, help="requests the engine decodes together")
    p.add_argument("--concurrency", type=int, default=16, help="requests the queue lets into the engine at once")
    p.add_argument("--auth", default=None, help="user:pass, or a file with one user:pass per line")
    p.add_argument("--random", choices=["tiny", "full"], default=None, help="random-weight model (tests, demos)")
    p.add_argument("--voices-dir", default="voices", help="where saved voices are kept")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the LLM decode step on CUDA: faster decoding, slower to start (see README)")
    p.add_argument("--max-file-size", type=int, default=20, help="upload limit of the web UI in MiB (prompt audio)")
    p.add_argument("--api-key", default=os.environ.get("COSYVOICE_API_KEY"),
                   help="bearer token the HTTP API (/v1/*, /health, /metrics) requires (default: COSYVOICE_API_KEY)")
    args = p.parse_args(argv)
    if args.concurrency < 1 or args.max_batch_size < 1 or args.max_file_size < 1:
        p.error("--concurrency, --max-batch-size and --max-file-size must be >= 1")
    return args


def parse_auth(value: str | None) -> list[tuple[str, str]] | None:
    """`user:pass`, or a file of such lines (blank lines and # comments skipped)."""
    if not value:
        return None
    lines = Path(value).read_text().splitlines() if os.path.isfile(value) else [value]
    pairs = [tuple(line.strip().split(":", 1)) for line in lines if line.strip() and not line.startswith("#")]
    if not pairs or any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise SystemExit("--auth: expected user:pass, or a file with one user:pass per line")
    return pairs


def exposure_warning(args: argparse.Namespace) -> str | None:
    """Anyone who can reach the port can use the GPU: say so when that is more than this machine."""
    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = False
    if loopback and not args.share:
        return None
    missing = [flag for flag, value in (("--auth", args.auth), ("--api-key", args.api_key)) if not value]
    if not missing:
        return None
    who = "anyone with the gradio.live share link" if args.share else f"anyone on the network ({args.host})"
    return (f"{who} can use this server: no {' and no '.join(missing)} set "
            "(--auth guards the web UI, --api-key the HTTP API).")


def _examples(kind: str) -> list[list[str]]:
    """Example rows from the prompt voices `assets/make_prompts.sh` made (NAME.wav + its transcript NAME.txt)."""
    voices = {p.stem: (str(p), p.with_suffix(".txt").read_text().strip()) for p in sorted(ASSETS.glob("*.wav"))}
    rows = []
    for name, (wav, transcript) in voices.items():
        zh = name.startswith("zh")
        if kind == "zero_shot":
            target = "今天天气真不错，我们一起去公园散步吧。" if zh else "The quick brown fox jumps over the lazy dog."
            rows.append([wav, transcript, target])
        elif kind == "cross_lingual":
            target = "This voice was cloned from a Chinese prompt." if zh else "这个声音是从一段英文录音克隆的。"
            rows.append([wav, target])
        else:
            instruct = "用开心的语气说这句话" if zh else "Speak slowly, in a calm and gentle voice."
            rows.append([wav, instruct, "Streaming speech synthesis should feel instant."])
    return rows


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


def _run(engine: Engine, request: SynthesisRequest) -> Iterator[tuple]:
    """Yields (streamed int16 chunk, full clip, metrics) updates; engine errors become one-line gr.Errors."""
    start = time.perf_counter()
    pcm, first, batch, chunk, stream = [], 0.0, 1, None, None
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
    except CosyVoiceError as e:
        raise gr.Error(str(e), print_exception=False) from None
    except Exception:
        log.exception("synthesis failed")
        raise gr.Error("Synthesis failed with an internal error; the server log has the details.",
                       print_exception=False) from None
    finally:
        if stream is not None:
            stream.close()  # a closed engine stream cancels the request and frees its batch slot
    if chunk is None:
        raise gr.Error("The model produced no audio for this text.", print_exception=False)
    if not chunk.is_last:  # the full clip normally rides with the last chunk
        yield gr.skip(), (chunk.sample_rate, np.concatenate(pcm)), metrics


def _request(text, mode: Mode, stream_on, speed, seed, **fields) -> SynthesisRequest:
    """A request from UI values; empty fields (a cleared number box, an API caller's None) take the defaults.
    Anything else goes to the engine as it came, so that its checks word the error."""
    seed = 0 if seed is None else seed
    if isinstance(seed, float) and seed.is_integer():  # gr.Number may deliver 3.0
        seed = int(seed)
    return SynthesisRequest(text or "", mode, stream=bool(stream_on), speed=1.0 if speed is None else speed,
                            seed=seed, **fields)


def _whole(engine: Engine, request: SynthesisRequest) -> Iterator:
    yield engine.synthesize(request)


def engine_call(fn: Callable, *args):
    """Calls an engine method, turning its user-facing errors into gr.Error (message only, no traceback)."""
    try:
        return fn(*args)
    except CosyVoiceError as e:
        raise gr.Error(str(e), print_exception=False) from None


def _voice_choices(engine: Engine) -> list[str]:
    return sorted(set(engine.list_voices()) | set(engine.info.get("speakers") or []))


def model_name(info: dict) -> str:
    """"random tiny" / "random full", or the model folder's name (not the server's full path)."""
    return info["model"] if info["is_random"] else Path(info["model"]).name


def _engine_status(engine: Engine) -> str:
    info, st = engine.info, engine.stats()
    return (
        f"Model: {model_name(info)} · {info['precision']} on {info['device']}  \n"
        f"Batch: {st['batch_size']} running now (max {info['max_batch_size']}), {st['waiting']} waiting  \n"
        f"Requests: {st['completed']} done, {st['failed']} failed  \n"
        f"Flow history: {st['flow_pages_used']} of {st['flow_pages']} pages in use (1 s of audio each), "
        f"{st['flow_prefix_hits']} prompt prefixes reused"
    )


def random_notice(engine: Engine, args: argparse.Namespace) -> str:
    why = "--random was given" if args.random else "No model folder found"
    return f"{why}: running a built-in random-weight model ({engine.info['model']}). Its audio is noise."


def _banner(engine: Engine, args: argparse.Namespace) -> str:
    lines = ["# CosyVoice2 · cosyvoice-opt", "Streaming zero-shot speech synthesis on a batching engine."]
    if engine.info["is_random"]:
        lines.append(f"> **{random_notice(engine, args)}** {WEIGHTS_HELP}")
    warning = exposure_warning(args)
    if warning:
        lines.append(f"> **Warning:** {warning}")
    return "\n\n".join(lines)


def _prompt_audio(elem_id: str) -> gr.Audio:
    return gr.Audio(label="Prompt audio (3-30 s, upload or record)", sources=["upload", "microphone"],
                    type="filepath", format="wav", elem_id=elem_id)


def _target_text(elem_id: str) -> gr.Textbox:
    return gr.Textbox(label="Text to speak", lines=3, elem_id=elem_id,
                      value="Hello! This is a streaming speech synthesis demo running on cosyvoice-opt.")


def build_app(engine: Engine, args: argparse.Namespace, monitor: Monitor | None = None) -> gr.Blocks:
    """The Blocks app over a ready engine. `monitor` defaults to a started Monitor sampling every second."""
    monitor = monitor or Monitor().start()
    gr.set_static_paths([ASSETS])
    synth = {"concurrency_limit": args.concurrency, "concurrency_id": "synthesis"}

    with gr.Blocks(title="CosyVoice2 · cosyvoice-opt") as demo:
        with gr.Sidebar(label="Monitor", width=340):
            gr.Markdown("### GPU")
            gpu_md = gr.Markdown(monitor.summary(), elem_id="gpu_panel")
            unit, mem = ("GPU", "memory") if monitor.has_gpu else ("CPU", "RAM")
            gpu_plot = gr.LinePlot(monitor.history(), x="seconds", y="percent", color="series", y_lim=[0, 100],
                                   x_lim=[-60, 0], x_title="seconds ago", y_title="%", height=260,
                                   color_map={f"{unit} util %": "#2563eb", f"{mem} %": "#f97316"},
                                   label=f"Last 60 s: {unit} util (blue), {mem} (orange)", elem_id="gpu_plot")
            gr.Markdown("### Engine")
            engine_md = gr.Markdown(_engine_status(engine), elem_id="engine_panel")
            gr.Timer(1.0).tick(lambda: (monitor.summary(), monitor.history(), _engine_status(engine)),
                               outputs=[gpu_md, gpu_plot, engine_md], show_progress="hidden", queue=False,
                               api_visibility="private")

        gr.Markdown(_banner(engine, args), elem_id="banner")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                with gr.Tabs():
                    with gr.Tab("3 s clone", id="zero_shot"):
                        with gr.Row():
                            zs_audio = _prompt_audio("zero_shot_prompt")
                            zs_prompt_text = gr.Textbox(label="Transcript of the prompt audio", lines=3,
                                                        elem_id="zero_shot_prompt_text")
                        zs_text = _target_text("zero_shot_text")
                        gr.Examples(_examples("zero_shot"), [zs_audio, zs_prompt_text, zs_text],
                                    label="Example voices")
                        with gr.Row():
                            voice_name = gr.Textbox(label="Save this prompt as a voice", placeholder="name",
                                                    scale=3)
                            save_btn = gr.Button("Save voice", scale=1)
                        zs_btn = gr.Button("Generate", variant="primary", elem_id="zero_shot_btn")
                    with gr.Tab("Cross-lingual", id="cross_lingual"):
                        cl_audio = _prompt_audio("cross_lingual_prompt")
                        cl_text = _target_text("cross_lingual_text")
                        gr.Examples(_examples("cross_lingual"), [cl_audio, cl_text], label="Example voices")
                        cl_btn = gr.Button("Generate", variant="primary", elem_id="cross_lingual_btn")
                    with gr.Tab("Instruct", id="instruct2"):
                        in_audio = _prompt_audio("instruct2_prompt")
                        in_instruct = gr.Textbox(label="Instruction (style, emotion, dialect)",
                                                 value="Speak slowly, in a calm and gentle voice.",
                                                 elem_id="instruct2_instruct")
                        in_text = _target_text("instruct2_text")
                        gr.Examples(_examples("instruct2"), [in_audio, in_instruct, in_text],
                                    label="Example voices")
                        in_btn = gr.Button("Generate", variant="primary", elem_id="instruct2_btn")
                    with gr.Tab("Saved voice", id="sft"):
                        with gr.Row():
                            voice = gr.Dropdown(_voice_choices(engine), label="Voice", scale=3, allow_custom_value=True,
                                            elem_id="sft_voice")
                            refresh_btn = gr.Button("Refresh", scale=1)
                            delete_btn = gr.Button("Delete", variant="stop", scale=1)
                        sft_text = _target_text("sft_text")
                        sft_btn = gr.Button("Generate", variant="primary", elem_id="sft_btn")
                voice_status = gr.Markdown(elem_id="voice_status")
            with gr.Column(scale=2):
                out_stream = gr.Audio(label="Output (streaming)", streaming=True, autoplay=True,
                                      elem_id="out_stream")
                out_full = gr.Audio(label="Full clip (download)", type="numpy", format="wav", interactive=False,
                                    elem_id="out_full")
                metrics = gr.JSON(label="Request metrics", elem_id="metrics")
                with gr.Accordion("Options", open=True):
                    with gr.Row():
                        stream = gr.Checkbox(True, label="Stream (play while generating)", elem_id="stream")
                        speed = gr.Slider(0.5, 2.0, value=1.0, step=0.05, label="Speed (non-streaming only)")
                    with gr.Row():
                        seed = gr.Number(0, label="Seed", precision=0, minimum=0, maximum=MAX_SEED)
                        dice = gr.Button("🎲", scale=0, min_width=60)
                with gr.Accordion("Optimisation", open=True):
                    with gr.Row():
                        precision = gr.Dropdown(PRECISIONS, value=engine.info["precision"], label="Precision")
                        precision_btn = gr.Button("Apply (drains in-flight requests, then reloads)")
                    batch = gr.Slider(1, max(256, engine.info["max_batch_size"]), step=1,
                                      label="Engine max batch size", value=engine.info["max_batch_size"])
                    gr.Number(args.concurrency, label="Queue concurrency (set at launch: --concurrency)",
                              interactive=False)
                    settings_status = gr.Markdown(elem_id="settings_status")
        outputs = [out_stream, out_full, metrics]

        def zero_shot(text, prompt_audio, prompt_text, stream_on, speed_v, seed_v):
            """3 s clone: speak `text` in the voice of `prompt_audio`, whose transcript is `prompt_text`."""
            yield from _run(engine, _request(text, Mode.ZERO_SHOT, stream_on, speed_v, seed_v,
                                             prompt_audio=prompt_audio, prompt_text=prompt_text or ""))

        def cross_lingual(text, prompt_audio, stream_on, speed_v, seed_v):
            """Speak `text` (any supported language) in the voice of `prompt_audio`; no transcript needed."""
            yield from _run(engine, _request(text, Mode.CROSS_LINGUAL, stream_on, speed_v, seed_v,
                                             prompt_audio=prompt_audio))

        def instruct2(text, prompt_audio, instruct_text, stream_on, speed_v, seed_v):
            """Speak `text` in the voice of `prompt_audio`, styled by the natural-language `instruct_text`."""
            yield from _run(engine, _request(text, Mode.INSTRUCT2, stream_on, speed_v, seed_v,
                                             prompt_audio=prompt_audio, instruct_text=instruct_text or ""))

        def sft(text, voice_name, stream_on, speed_v, seed_v):
            """Speak `text` with a saved voice (see /list_voices)."""
            if not voice_name:
                raise gr.Error("Pick a saved voice first (save one from the 3 s clone tab).", print_exception=False)
            yield from _run(engine, _request(text, Mode.SFT, stream_on, speed_v, seed_v, voice=voice_name))

        def save_voice(name, prompt_audio, prompt_text):
            """Saves the prompt audio + transcript under `name` for the Saved voice tab and /sft."""
            name = (name or "").strip()
            engine_call(engine.save_voice, name, prompt_audio, prompt_text or "")
            return f"Saved voice **{name}**.", gr.Dropdown(choices=_voice_choices(engine), value=name)

        def delete_voice(name):
            """Deletes a saved voice."""
            if not name:
                raise gr.Error("Pick a saved voice to delete.", print_exception=False)
            engine_call(engine.delete_voice, name)
            return f"Deleted voice **{name}**.", gr.Dropdown(choices=_voice_choices(engine), value=None)

        def list_voices() -> list[str]:
            """Names of the saved voices (and any built-in SFT speakers)."""
            return _voice_choices(engine)

        def set_precision(value):
            """Drains in-flight requests and reloads the model in `value` (fp32, fp16 or bf16)."""
            yield f"Draining in-flight requests and reloading in {value}…"
            start = time.perf_counter()
            try:
                engine.set_precision(value)
            except CosyVoiceError as e:
                gr.Warning(str(e))
                yield f"Still running in {engine.info['precision']}: {e}"
                return
            yield f"Running in {engine.info['precision']} (reloaded in {time.perf_counter() - start:.1f} s)."

        def set_max_batch_size(n):
            """Sets how many requests the engine decodes together (applies from the next step)."""
            engine_call(engine.set_max_batch_size, int(n))
            return f"Engine max batch size: {engine.info['max_batch_size']}."

        mode_inputs = [stream, speed, seed]
        zs_btn.click(zero_shot, [zs_text, zs_audio, zs_prompt_text, *mode_inputs], outputs, api_name="zero_shot",
                     **synth)
        cl_btn.click(cross_lingual, [cl_text, cl_audio, *mode_inputs], outputs, api_name="cross_lingual", **synth)
        in_btn.click(instruct2, [in_text, in_audio, in_instruct, *mode_inputs], outputs, api_name="instruct2",
                     **synth)
        sft_btn.click(sft, [sft_text, voice, *mode_inputs], outputs, api_name="sft", **synth)
        save_btn.click(save_voice, [voice_name, zs_audio, zs_prompt_text], [voice_status, voice],
                       api_name="save_voice")
        delete_btn.click(delete_voice, [voice], [voice_status, voice], api_name="delete_voice")
        def refresh_voices():
            return gr.Dropdown(choices=_voice_choices(engine))

        refresh_btn.click(refresh_voices, None, voice, api_visibility="private")
        demo.load(refresh_voices, None, voice, api_visibility="private")
        gr.api(list_voices, api_name="list_voices")
        precision_btn.click(set_precision, precision, settings_status, api_name="set_precision",
                            concurrency_limit=1, concurrency_id="reload")
        batch.release(set_max_batch_size, batch, settings_status, api_name="set_max_batch_size")
        dice.click(lambda: random.randint(0, MAX_SEED), None, seed, queue=False, api_visibility="private")
    return demo


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # gradio's own startup probes
    args = parse_args(argv)
    auth = parse_auth(args.auth)
    warning = exposure_warning(args)
    if warning:
        log.warning(warning)
    config = EngineConfig(precision=args.precision, max_batch_size=args.max_batch_size, random_size=args.random,
                          voices_dir=args.voices_dir, compile=args.compile)
    try:
        engine = Engine.from_model_dir(args.model_dir, config)
    except CosyVoiceError as e:
        sys.exit(f"error: {e}")
    if engine.info["is_random"]:
        log.warning("%s %s", random_notice(engine, args), WEIGHTS_HELP.replace("`", ""))
    monitor = Monitor().start()
    demo = build_app(engine, args, monitor)
    try:
        app, _, _ = demo.queue(default_concurrency_limit=args.concurrency).launch(
            server_name=args.host, server_port=args.port, share=args.share, auth=auth,
            allowed_paths=[str(ASSETS)], max_file_size=args.max_file_size << 20, prevent_thread_lock=True)
        mount_api(app, engine, args.api_key)  # the OpenAI-style API shares the UI's server and port
        demo.block_thread()
    finally:
        monitor.stop()
        engine.close()


if __name__ == "__main__":
    main()
