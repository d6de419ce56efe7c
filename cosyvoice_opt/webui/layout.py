"""The WebUI page: components, their limits (all from limits.py) and the events that wire them to the handlers."""

from __future__ import annotations

import argparse
import html
import logging
import random
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Protocol

import gradio as gr
import pandas as pd

from cosyvoice_opt import limits
from cosyvoice_opt.engine.counters import stage_use
from cosyvoice_opt.frontend.instructions import INSTRUCTIONS
from cosyvoice_opt.monitor import Monitor
from cosyvoice_opt.webui.handlers import REPLACE_LABEL, Generation, check_prompt, on_page, voice_choices
from cosyvoice_opt.webui.settings import (
    BATCH_LABEL,
    BATCH_SLIDER_MAX,
    PRECISION_LABEL,
    PRECISIONS,
    QUEUE_WAIT_LABEL,
    Settings,
    SettingsAccess,
    can_set_queue_wait,
    label,
    max_queue_wait,
)

log = logging.getLogger("cosyvoice_opt.webui")


class Panel(Protocol):
    """What the sidebar's GPU panel reads: a `Monitor` of this process's GPU, or the cluster's, one row per
    replica."""

    has_gpu: bool

    def summary(self) -> str: ...

    def history(self) -> pd.DataFrame: ...

    def rows(self) -> list[dict]: ...


ASSETS = Path(__file__).resolve().parents[2] / "assets"
WEIGHTS_HELP = (
    "Download CosyVoice2-0.5B from ModelScope (`iic/CosyVoice2-0.5B`) or Hugging Face "
    "(`FunAudioLLM/CosyVoice2-0.5B`), then pass `--model-dir DIR` or set `COSYVOICE_MODEL_DIR`."
)
# Passed to launch() (Gradio 6 takes page CSS there): the example tables fit the column and wrap their texts
# instead of scrolling sideways.
CSS = """
.examples table { table-layout: fixed; width: 100%; }
.examples td, .examples th { white-space: normal; overflow-wrap: anywhere; }
"""
SPEED_STREAMING = "Speed (1.0 while streaming: turn streaming off to change it)"
VOICE_KEEPS_AUDIO = "A saved voice keeps its prompt audio, so it speaks with CosyVoice2 and CosyVoice3 models alike."


def voice_dropdown(engine: Any, elem_id: str, label: str = "Voice") -> gr.Dropdown:
    """A saved-voice picker, described to API clients as a plain string. Gradio describes a dropdown as the enum
    of the choices it had when the page was built (`Literal[]` before any voice is saved), but voices come and go
    at run time and the engine checks the name. (A Dropdown subclass would make Gradio write a .pyi stub next to
    this module, so each instance gets its own api_info.)"""
    dropdown = gr.Dropdown(voice_choices(engine), value=None, label=label, scale=3, allow_custom_value=True,
                           elem_id=elem_id)
    dropdown.api_info = lambda: {"type": "string", "description": "name of a saved voice (see /list_voices)"}
    return dropdown


def prompt_label() -> str:
    """What a prompt may be (the engine's limits) and what clones best."""
    lo, hi = limits.RECOMMENDED_PROMPT_SECONDS
    return (f"Prompt audio: {limits.MIN_PROMPT_SECONDS:g}-{limits.MAX_PROMPT_SECONDS:g} s accepted, {lo:g}-{hi:g} s "
            "of clear speech clones best (upload or record)")


def quiet_range_errors() -> None:
    """Gradio refuses a number outside its component's range (a seed of -1, an API caller's speed of 0) before any
    handler runs, with an error that prints a traceback to the log. The refusal stays, worded as Gradio words it;
    the log gets one line. Patched on the class: Gradio rebuilds a component that an event updates, so a patch of
    one instance would not last."""
    check = gr.Number.raise_if_out_of_bounds
    if getattr(check, "quiet", False):
        return

    def one_line(num: float | int, minimum: float | int | None, maximum: float | int | None) -> None:
        try:
            check(num, minimum, maximum)
        except gr.Error as e:
            log.info("input refused: %s", e.message)
            raise gr.Error(e.message, print_exception=False) from None

    one_line.quiet = True
    gr.Number.raise_if_out_of_bounds = staticmethod(one_line)


def speed_control(stream: bool) -> gr.Slider:
    """Speed is a time stretch of the whole clip, which streaming cannot do: while streaming is on the control is
    reset to 1.0 and disabled, so that no tab can send a speed the engine refuses."""
    if stream:
        return gr.Slider(value=1.0, interactive=False, label=SPEED_STREAMING)
    return gr.Slider(interactive=True, label="Speed")


def random_seed() -> int:
    """The dice: any seed the engine accepts."""
    return random.randint(0, limits.MAX_SEED)


def examples(kind: str) -> list[list[str]]:
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


def example_table(rows: list[list[str]], inputs: list[gr.components.Component], elem_id: str) -> gr.Dataset:
    """The example voices as a table whose texts wrap in full: gr.Examples shows a Textbox cell cut at 60
    characters (and the table scrolls sideways), so the text columns are shown as HTML and a click fills the
    inputs with the row as written."""
    table = gr.Dataset(components=["audio" if isinstance(c, gr.Audio) else "html" for c in inputs],
                       headers=[c.label for c in inputs], label="Example voices", type="index", elem_id=elem_id,
                       elem_classes="examples",
                       samples=[[cell if isinstance(c, gr.Audio) else html.escape(cell)
                                 for c, cell in zip(inputs, row, strict=True)] for row in rows])
    table.click(lambda i: rows[i], table, inputs, queue=False, api_visibility="private")
    return table


def model_name(info: dict) -> str:
    """"random tiny" / "random full", or the model folder's name (not the server's full path)."""
    return info["model"] if info["is_random"] else Path(info["model"]).name


class EngineStatus:
    """The sidebar's engine panel: model, batch, queue and flow-cache use, and where the engine's time went over the
    last `WINDOW_S` seconds (each thread's busy share, from its counters: the vocoder near 100 % busy means the engine
    is at its capacity), refreshed every second. A cluster's stats are summed over its replicas (`replicas` says how
    many report; the max batch is each one's, and the busy shares are their mean)."""

    WINDOW_S = 10.0

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._seen: deque[tuple[float, dict]] = deque()  # (monotonic time, stats) of the window's refreshes
        self._lock = threading.Lock()  # several pages refresh it

    def __call__(self) -> str:
        info, st = self.engine.info, self.engine.stats()
        tokens = f" · speech tokens: {info['speech_tokenizer']}" if "speech_tokenizer" in info else ""
        model = f"Model: {model_name(info)} · {info['precision']} on {info['device']}{tokens}  \n"
        if "batch_size" not in st:
            return f"{model}No engine reports yet."
        wait = f" (refused after {info['max_queue_wait']:g} s)" if "max_queue_wait" in info else ""
        where = f" on {st['replicas']} replicas" if "replicas" in st else ""
        each = " each" if "replicas" in st else ""
        return (
            f"{model}"
            f"Batch: {st['batch_size']} running now{where} (max {info['max_batch_size']}{each}), {st['waiting']} "
            f"waiting{wait}  \n"
            f"Requests: {st['completed']} done, {st['failed']} failed  \n"
            f"Flow history: {st['flow_pages_used']} of {st['flow_pages']} pages in use (1 s of audio each), "
            f"{st['flow_prefix_hits']} prompt prefixes reused{self._time_line(st)}"
        )

    def _time_line(self, st: dict) -> str:
        now = time.monotonic()
        with self._lock:
            self._seen.append((now, st))
            while len(self._seen) > 2 and now - self._seen[1][0] >= self.WINDOW_S:
                self._seen.popleft()
            t0, first = self._seen[0]
        use = stage_use(first, st, now - t0) if now - t0 >= 1.0 else None
        if use is None:
            return ""
        n = st.get("replicas", 1) or 1
        return (f"  \nTime (last {now - t0:.0f} s): LLM {use['llm_busy_pct'] / n:.0f} % busy, "
                f"{use['llm_steps_per_s'] / n:.0f} steps/s of {use['llm_rows_per_step']:.1f} rows; vocoder "
                f"{use['vocoder_busy_pct'] / n:.0f} % busy, {use['rounds_per_s'] / n:.1f} rounds/s of "
                f"{use['chunks_per_round']:.1f} chunks")


def random_notice(engine: Any, args: argparse.Namespace) -> str:
    why = "--random was given" if args.random else "No model folder found"
    return f"{why}: running a built-in random-weight model ({engine.info['model']}). Its audio is noise."


def banner(engine: Any, args: argparse.Namespace, warning: str | None) -> str:
    family = engine.info.get("family_name", "CosyVoice2")
    lines = [f"# {family} · cosyvoice-opt", "Streaming zero-shot speech synthesis on a batching engine."]
    if engine.info["is_random"]:
        lines.append(f"> **{random_notice(engine, args)}** {WEIGHTS_HELP}")
    if warning:
        lines.append(f"> **Warning:** {warning}")
    return "\n\n".join(lines)


def _prompt_audio(elem_id: str) -> tuple[gr.Audio, gr.Markdown]:
    """A prompt input and the line under it that names the file's problems as soon as it arrives. No format
    conversion: the file reaches the engine as uploaded, so the check and Generate judge the same bytes."""
    audio = gr.Audio(label=prompt_label(), sources=["upload", "microphone"], type="filepath", elem_id=elem_id)
    check = gr.Markdown(elem_id=f"{elem_id}_check")
    for event in (audio.upload, audio.stop_recording):
        event(check_prompt, audio, check, api_visibility="private")
    audio.clear(lambda: "", None, check, queue=False, api_visibility="private")
    return audio, check


def _status(elem_id: str) -> gr.Markdown:
    """A tab's status line, under its button: why the last Generate failed, in the tab's words."""
    return gr.Markdown(elem_id=elem_id)


def _instruction_presets(instruction: gr.Textbox) -> gr.Dropdown:
    """CosyVoice3's trained instructions (dialects, volume, speed, emotions, roles): picking one fills the
    instruction, which stays editable (free text works too)."""
    presets = gr.Dropdown(choices=[(f"{i.kind}: {i.name}", i.text) for i in INSTRUCTIONS], value=None,
                          label="Instruction presets (CosyVoice3)", elem_id="instruct2_presets")
    presets.change(lambda text: text or gr.update(), presets, instruction, queue=False, api_visibility="private")
    return presets


def _target_text(elem_id: str) -> gr.Textbox:
    return gr.Textbox(label="Text to speak", lines=3, elem_id=elem_id, max_length=limits.MAX_TEXT_CHARS,
                      value="Hello! This is a streaming speech synthesis demo running on cosyvoice-opt.")


def build_app(engine: Any, args: argparse.Namespace, monitor: Panel | None = None,
              warning: str | None = None, access: SettingsAccess | None = None) -> gr.Blocks:
    """The Blocks page over a ready engine (an `Engine`, or the cluster's `RemoteEngine`); `launch` or `mount_ui`
    serves it. `monitor` defaults to a started Monitor sampling every second; `warning` is the exposure warning
    the banner shows; `access` defaults to the rule of --auth and --allow-settings."""
    monitor = monitor or Monitor().start()
    gr.set_static_paths([ASSETS])
    quiet_range_errors()
    synth = {"concurrency_limit": args.concurrency, "concurrency_id": "synthesis"}
    gen = Generation(engine)
    access = access or SettingsAccess(auth=bool(args.auth), allow=args.allow_settings)
    settings = Settings(engine, access)
    editable = access.auth or access.allow  # at build time; every page load sets it per visitor
    info = engine.info

    with gr.Blocks(title="CosyVoice2 · cosyvoice-opt") as demo:
        with gr.Sidebar(label="Monitor", width=340):
            gr.Markdown("### GPU")
            gpu_md = gr.Markdown(monitor.summary(), elem_id="gpu_panel")
            unit, mem = ("GPU", "memory") if monitor.has_gpu else ("CPU", "RAM")
            # No fixed height: the plot grows by its legend (under the axis in a narrow sidebar) instead of cutting it.
            gpu_plot = gr.LinePlot(monitor.history(), x="seconds", y="percent", color="series", y_lim=[0, 100],
                                   x_lim=[-60, 0], x_title="seconds ago", y_title="%",
                                   color_title="", color_map={f"{unit} util %": "#2563eb", f"{mem} %": "#f97316"},
                                   label=f"Last 60 s: {unit} util, {mem}", elem_id="gpu_plot")
            gr.Markdown("### Engine")
            engine_status = EngineStatus(engine)
            engine_md = gr.Markdown(engine_status(), elem_id="engine_panel")
            gr.Timer(1.0).tick(lambda: (monitor.summary(), monitor.history(), engine_status()),
                               outputs=[gpu_md, gpu_plot, engine_md], show_progress="hidden", queue=False,
                               api_visibility="private")

        gr.Markdown(banner(engine, args, warning), elem_id="banner")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                with gr.Tabs():
                    with gr.Tab("3 s clone", id="zero_shot"):
                        with gr.Row():
                            with gr.Column():
                                zs_audio, _ = _prompt_audio("zero_shot_prompt")
                            zs_prompt_text = gr.Textbox(label="Transcript of the prompt audio", lines=3,
                                                        max_length=limits.MAX_TEXT_CHARS,
                                                        elem_id="zero_shot_prompt_text")
                        zs_text = _target_text("zero_shot_text")
                        example_table(examples("zero_shot"), [zs_audio, zs_prompt_text, zs_text], "examples")
                        with gr.Row():
                            voice_name = gr.Textbox(label="Save this prompt as a voice", placeholder="name",
                                                    info=VOICE_KEEPS_AUDIO, scale=3, elem_id="voice_name")
                            overwrite = gr.Checkbox(False, label=REPLACE_LABEL, scale=1, elem_id="voice_overwrite")
                            save_btn = gr.Button("Save voice", scale=1, elem_id="save_voice_btn")
                        zs_btn = gr.Button("Generate", variant="primary", elem_id="zero_shot_btn")
                        zs_status = _status("zero_shot_status")
                    with gr.Tab("Cross-lingual", id="cross_lingual"):
                        cl_audio, _ = _prompt_audio("cross_lingual_prompt")
                        cl_text = _target_text("cross_lingual_text")
                        example_table(examples("cross_lingual"), [cl_audio, cl_text], "cross_lingual_examples")
                        cl_btn = gr.Button("Generate", variant="primary", elem_id="cross_lingual_btn")
                        cl_status = _status("cross_lingual_status")
                    with gr.Tab("Instruct", id="instruct2"):
                        in_audio, _ = _prompt_audio("instruct2_prompt")
                        in_instruct = gr.Textbox(label="Instruction (style, emotion, dialect)",
                                                 value="Speak slowly, in a calm and gentle voice.",
                                                 max_length=limits.MAX_TEXT_CHARS, elem_id="instruct2_instruct")
                        if engine.info.get("family") == "cosyvoice3":
                            _instruction_presets(in_instruct)
                        in_text = _target_text("instruct2_text")
                        example_table(examples("instruct2"), [in_audio, in_instruct, in_text], "instruct2_examples")
                        in_btn = gr.Button("Generate", variant="primary", elem_id="instruct2_btn")
                        in_status = _status("instruct2_status")
                    with gr.Tab("Saved voice", id="sft"):
                        with gr.Row():
                            voice = voice_dropdown(engine, "sft_voice")
                            refresh_btn = gr.Button("Refresh", scale=1)
                            delete_btn = gr.Button("Delete", variant="stop", scale=1)
                        sft_text = _target_text("sft_text")
                        sft_btn = gr.Button("Generate", variant="primary", elem_id="sft_btn")
                        sft_status = _status("sft_status")
                    with gr.Tab("Live text", id="live_text"):
                        gr.Markdown("The text arrives word by word while it is spoken, as a chat model's reply "
                                    "would: the audio starts before the text ends.")
                        with gr.Row():
                            with gr.Column():
                                lt_audio, _ = _prompt_audio("live_prompt")
                            lt_prompt_text = gr.Textbox(label="Transcript of the prompt audio", lines=3,
                                                        max_length=limits.MAX_TEXT_CHARS, elem_id="live_prompt_text")
                        lt_voice = voice_dropdown(engine, "live_voice",
                                                  "Saved voice (instead of the prompt audio and its transcript)")
                        lt_text = _target_text("live_text")
                        example_table(examples("zero_shot"), [lt_audio, lt_prompt_text, lt_text], "live_examples")
                        lt_rate = gr.Slider(*limits.LIVE_WORDS_PER_S_RANGE, value=limits.LIVE_WORDS_PER_S, step=0.5,
                                            label="Words per second the text arrives at", elem_id="live_rate")
                        lt_btn = gr.Button("Speak as it arrives", variant="primary", elem_id="live_text_btn")
                        lt_status = _status("live_text_status")
                voice_status = gr.Markdown(label="Voice status", elem_id="voice_status")
            with gr.Column(scale=2):
                out_stream = gr.Audio(label="Output (streaming)", streaming=True, autoplay=True,
                                      elem_id="out_stream")
                out_full = gr.Audio(label="Full clip (download)", type="numpy", format="wav", interactive=False,
                                    elem_id="out_full")
                metrics = gr.JSON(label="Request metrics", elem_id="metrics")
                with gr.Accordion("Options", open=True):
                    with gr.Row():
                        stream = gr.Checkbox(True, label="Stream (play while generating)", elem_id="stream")
                        speed = gr.Slider(*limits.SPEED_RANGE, value=1.0, step=0.05, interactive=False,
                                          label=SPEED_STREAMING, elem_id="speed")
                    with gr.Row():
                        seed = gr.Number(0, label="Seed", precision=0, minimum=0, maximum=limits.MAX_SEED,
                                         elem_id="seed")
                        dice = gr.Button("🎲", scale=0, min_width=60, elem_id="dice")
                with gr.Accordion("Engine settings (operator)", open=True):
                    with gr.Row():
                        precision = gr.Dropdown(PRECISIONS, value=info["precision"],
                                                label=label(PRECISION_LABEL, editable), interactive=editable,
                                                elem_id="precision")
                        precision_btn = gr.Button("Apply (drains in-flight requests, then reloads)",
                                                  interactive=editable, elem_id="precision_btn")
                    batch = gr.Slider(1, max(BATCH_SLIDER_MAX, info["max_batch_size"]), step=1,
                                      value=info["max_batch_size"], label=label(BATCH_LABEL, editable),
                                      interactive=editable, elem_id="max_batch_size")
                    wait_editable = editable and can_set_queue_wait(engine)
                    queue_wait = gr.Slider(*limits.MAX_QUEUE_WAIT_RANGE, step=0.5, value=max_queue_wait(engine),
                                           label=label(QUEUE_WAIT_LABEL, wait_editable),
                                           interactive=wait_editable, elem_id="max_queue_wait")
                    gr.Number(args.concurrency, label="Queue concurrency (set at launch: --concurrency)",
                              interactive=False)
                    settings_note = gr.Markdown("" if editable else access.note, elem_id="settings_note")
                    settings_status = gr.Markdown(label="Settings status", elem_id="settings_status")
        outputs = [out_stream, out_full, metrics]
        mode_inputs = [stream, speed, seed]

        def generation(button: gr.Button, handler: Any, inputs: list, status: gr.Markdown, api_name: str) -> None:
            """The page's button writes errors into its tab's status line (`on_page`); the named API endpoint, on
            a trigger the page does not show, answers them as errors."""
            gr.Button(visible=False).click(handler, inputs, outputs, api_name=api_name, **synth)
            button.click(on_page(handler), inputs, [*outputs, status], api_name=f"{api_name}_page",
                         api_visibility="private", **synth)

        generation(zs_btn, gen.zero_shot, [zs_text, zs_audio, zs_prompt_text, *mode_inputs], zs_status, "zero_shot")
        generation(cl_btn, gen.cross_lingual, [cl_text, cl_audio, *mode_inputs], cl_status, "cross_lingual")
        generation(in_btn, gen.instruct2, [in_text, in_audio, in_instruct, *mode_inputs], in_status, "instruct2")
        generation(sft_btn, gen.sft, [sft_text, voice, *mode_inputs], sft_status, "sft")
        generation(lt_btn, gen.live_text, [lt_text, lt_audio, lt_prompt_text, lt_rate, seed, lt_voice], lt_status,
                   "live_text")
        save_btn.click(gen.save_voice, [voice_name, zs_audio, zs_prompt_text, overwrite], [voice_status, voice],
                       api_name="save_voice").then(gen.refresh_voices, None, lt_voice, api_visibility="private")
        delete_btn.click(gen.delete_voice, [voice], [voice_status, voice], api_name="delete_voice").then(
            gen.refresh_voices, None, lt_voice, api_visibility="private")
        refresh_btn.click(gen.refresh_voices, None, voice, api_visibility="private")
        lt_voice.focus(gen.refresh_voices, None, lt_voice, api_visibility="private")
        gr.api(gen.list_voices, api_name="list_voices")
        gr.api(monitor.rows, api_name="monitor")

        stream.change(speed_control, stream, speed, queue=False, api_visibility="private")
        dice.click(random_seed, None, seed, queue=False, api_visibility="private")

        precision_btn.click(settings.set_precision, precision, settings_status, api_name="set_precision",
                            concurrency_limit=1, concurrency_id="reload")
        # a refused value (out of range, not whole) puts the control back to what the engine has
        for control, setter, api_name in ((batch, settings.set_max_batch_size, "set_max_batch_size"),
                                          (queue_wait, settings.set_max_queue_wait, "set_max_queue_wait")):
            control.release(setter, control, settings_status, api_name=api_name).failure(
                settings.shown, None, [batch, queue_wait, settings_status], api_visibility="private")

        demo.load(gen.refresh_voices, None, voice, api_visibility="private")
        demo.load(gen.refresh_voices, None, lt_voice, api_visibility="private")
        demo.load(settings.panel, None, [precision, precision_btn, batch, queue_wait, settings_note],
                  api_visibility="private")
    return demo
