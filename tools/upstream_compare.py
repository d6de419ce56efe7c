"""Upstream's own CosyVoice2 (or 3) code beside cosyvoice-opt: one stream, streaming, the same random weights.

`python tools/upstream_compare.py --upstream-dir DIR --json OUT.json [--size full] [--tokens 250]`

DIR is a checkout of FunAudioLLM/CosyVoice with third_party/Matcha-TTS filled in. The steps:

1. A random model folder in the released layout (`random_model.write_random_model_folder`), or `--model-dir`.
2. Upstream, in a child process per precision (`--upstream-precision fp32,fp16`): `CosyVoice2(folder)` and
   `inference_zero_shot(text, prompt_text, prompt_wav, stream=True)`, the call its README gives, with the benchmark's
   synthetic 3 s prompt and texts. One unmeasured call, then `--runs` measured calls; a call's first packet is the
   time from the call to its first chunk, its RTF the time to the last chunk over the audio length. Stage times come
   from one more call whose frontend, LLM thread, flow and HiFT calls are timed (flow and HiFT synchronise the GPU),
   so the measured calls carry no timers.
3. Ours, in a child process: `python -m cosyvoice_opt bench --model-dir folder --stream 1 --concurrency 1`.

Both sides emit exactly `--tokens` speech tokens, since random weights stop at random: ours forces the count
(`--tokens`), and upstream's `sampling_ids` is wrapped to forbid every stop id before the count and to return one
at the count, which ends upstream's decode loop (`top_ids in stop_token_ids`). Upstream's `max_len` (20 tokens per
text token) must allow the count; the child checks it, and each call records the count it reached (`tokens_ok`).

Upstream as released keeps state across calls: `CosyVoice2Model.tts` doubles `token_hop_len` after each chunk
(25, 50, 100) on the model object and never resets it, so in a long-lived process every call after the first waits
for 103 tokens or more before its first chunk. The measured calls reset it to 25 first, which is upstream at its
best (a fresh process's first call); one call without the reset is reported as `as_served`.

What upstream needs to run here, outside its inference path, is bypassed in the child, each for the reason given:
- `modelscope` is imported for `snapshot_download` of a hub id; the folder is local, so an empty module stands in.
- `matcha.utils`'s `__init__` imports training tools (hydra, lightning loggers, gdown, wget, matplotlib); the
  inference path uses only `matcha.utils.audio` and `matcha.utils.pylogger`, so the package is registered
  without running its `__init__`.
- `torchaudio.load` goes through TorchCodec (FFmpeg) since torchaudio 2.9; upstream asks for its soundfile
  backend, so soundfile reads the prompt (float32, channels first, as that backend returned).
- `Qwen2ForCausalLM.from_pretrained(CosyVoice-BlankEN)` reads the blank Qwen2 weights of a released folder; a
  random folder holds the config only, and `llm.pt` then overwrites every weight (a strict load), so the Qwen2
  model is built from the config.
- Our random folder's `cosyvoice2.yaml` holds the model section; upstream's `CosyVoice2` also reads the
  tokenizer entries (`get_tokenizer`, `allowed_special`), so upstream gets a view of the folder (links to the
  same files) whose yaml adds those two entries as the released yaml has them.
- Upstream hard-codes 512 channels in the flow encoder's pre-lookahead and up-sampling layers, the released
  encoder width; a tiny model's are its own encoder width, so there those two layers are rebuilt at that width.

CosyVoice3 (`--family cosyvoice3`, full size only): the folder is written by upstream's own constructors from the
model section of its example `cosyvoice3.yaml` (the kit's copy of upstream), with the weights drawn by our
`randomize_` and saved as `llm.pt`, `flow.pt`, `hift.pt` beside our random frontend files (tokenizer folder, the
ONNX stand-ins; the speech tokenizer stand-in has the v3 file's I/O). Upstream then loads it with `CosyVoice3`.
The prompt text starts with upstream's system prompt and `<|endofprompt|>`, as its examples do; our random
tokenizer gives `<|endofprompt|>` another id than the released 151646 that `CosyVoice3LM` looks for, so the
frontend's encoder maps that one id. Ours runs on the same folder once our engine reads CosyVoice3 folders.

The upstream child runs with `--upstream-pythonpath` (or $UPSTREAM_PYTHONPATH) in front of PYTHONPATH, so its
packages never shadow ours in the other processes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOP_LEN = 25  # CosyVoice2Model.token_hop_len as constructed (CosyVoice3Model's too)
CV3_EXAMPLE_YAML = "examples/libritts/cosyvoice3/conf/cosyvoice3.yaml"
CV3_MODEL_KEYS = ("sample_rate", "llm_input_size", "llm_output_size", "spk_embed_dim", "qwen_pretrain_path",
                  "token_frame_rate", "token_mel_ratio", "chunk_size", "num_decoding_left_chunks", "llm", "flow",
                  "hift", "get_tokenizer", "allowed_special", "feat_extractor")
CV3_SYSTEM_PROMPT = "You are a helpful assistant.<|endofprompt|>"  # before the prompt text, as upstream's examples
ENDOFPROMPT, ENDOFPROMPT_ID = "<|endofprompt|>", 151646  # the id CosyVoice3LM.inference asserts on
TOKENIZER_ENTRIES = """
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
allowed_special: 'all'
"""


# ---- the parent: folder, children, one JSON ---------------------------------------------------------------------
def _workload(folder: Path) -> dict:
    """The closed-loop benchmark's prompt (written as a WAV file for upstream) and texts."""
    import soundfile as sf

    from cosyvoice_opt.bench.closed_loop import PROMPT_TEXT, TEXT
    from cosyvoice_opt.bench.workload import synthetic_prompt

    rate, wave = synthetic_prompt()
    wav = folder / "prompt.wav"
    sf.write(wav, wave, rate, subtype="FLOAT")
    return {"text": TEXT, "prompt_text": PROMPT_TEXT, "prompt_wav": str(wav), "prompt_s": len(wave) / rate}


def _child(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> dict:
    """Run a child with its output in `log`; its exit status and wall time."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=env,
                                cwd=REPO).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"rc": rc, "wall_s": time.perf_counter() - t0, "log": str(log)}


def _tail(path: str, lines: int = 30) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _write_json(path: str | Path, data: dict) -> None:
    """Whole or not at all: a child stopped by the budget leaves its last complete file."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _summary(result: dict) -> dict:
    out = {}
    for precision, up in result["upstream"].items():
        if up and up.get("runs"):
            out[f"upstream_{precision}"] = {"first_packet_p50_ms": up["first_packet_p50_ms"],
                                            "rtf_p50": up["rtf_p50"], "runs": len(up["runs"]),
                                            "tokens_ok": up["tokens_ok"], "stage_s": up.get("stage_s")}
    for row in (result.get("ours") or {}).get("results", []):
        out[f"ours_{row['precision']}"] = {"first_packet_p50_ms": row["first_packet_p50_ms"],
                                           "rtf_p50": row["rtf_p50"], "stage_s": row["stage_s"]}
    base = out.get("upstream_fp32")
    for key, ours in list(out.items()):
        if base and key.startswith("ours_"):
            ours["first_packet_x_sooner_than_upstream_fp32"] = base["first_packet_p50_ms"] / ours["first_packet_p50_ms"]
            ours["rtf_x_lower_than_upstream_fp32"] = base["rtf_p50"] / ours["rtf_p50"]
    return out


def compare(args: argparse.Namespace) -> int:
    import torch

    from cosyvoice_opt.config import Family, ModelConfig
    from cosyvoice_opt.random_model import write_frontend_files, write_random_model_folder

    t_start = time.perf_counter()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="upstream-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"args": vars(args), "upstream": {}, "ours": None, "children": {}}

    def save() -> None:
        result["summary"] = _summary(result)
        _write_json(args.json, result)

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    cuda = torch.cuda.is_available()
    result["env"] = {"python": platform.python_version(), "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name(0) if cuda else None,
                     "upstream_commit": _upstream_commit(Path(args.upstream_dir))}
    env = dict(os.environ)
    extra = args.upstream_pythonpath or os.environ.get("UPSTREAM_PYTHONPATH", "")
    upstream_env = env | {"PYTHONPATH": os.pathsep.join(p for p in (extra, env.get("PYTHONPATH", "")) if p)}
    t0 = time.perf_counter()
    if args.model_dir:
        folder = Path(args.model_dir)
    elif args.family == "cosyvoice2":
        folder = work / f"random-{args.size}"
        write_random_model_folder(folder, args.size, args.seed)
    else:
        frontend, folder = work / "random-frontend-full", work / "random-cosyvoice3-full"
        write_frontend_files(frontend, ModelConfig.full(Family.COSYVOICE3), args.seed)
        cmd = [sys.executable, __file__, "_write_cv3", "--upstream-dir", args.upstream_dir, "--frontend-dir",
               str(frontend), "--out-dir", str(folder), "--seed", str(args.seed)]
        child = result["children"]["write_cosyvoice3"] = _child(cmd, work / "write-cv3.log", left(), upstream_env)
        if child["rc"] != 0:
            child["tail"] = _tail(child["log"])
            save()
            print(child["tail"], file=sys.stderr)
            return 1
    result["model_write_s"] = None if args.model_dir else time.perf_counter() - t0
    result["model"] = {"dir": str(folder), "family": args.family, "size": None if args.model_dir else args.size,
                       "seed": args.seed}
    result["workload"] = _workload(work) | {"tokens": args.tokens, "stream": True, "concurrency": 1}
    save()

    def step_limit(last: bool) -> float:
        return max(1.0, left() if last else min(left(), args.step_s))

    def upstream(precision: str, last: bool) -> None:
        out = work / f"upstream-{precision}.json"
        cmd = [sys.executable, __file__, "_upstream", "--upstream-dir", args.upstream_dir, "--model-dir",
               str(folder), "--view-dir", str(work / "upstream-view"), "--family", args.family, "--precision",
               precision, "--tokens", str(args.tokens), "--runs", str(args.runs), "--workload",
               json.dumps(result["workload"]), "--json", str(out)]
        child = _child(cmd, work / f"upstream-{precision}.log", step_limit(last), upstream_env)
        result["children"][f"upstream_{precision}"] = child
        result["upstream"][precision] = _read_json(out)
        if child["rc"] != 0:
            child["tail"] = _tail(child["log"])
        save()

    def ours(last: bool) -> None:
        out = work / "ours.json"
        cmd = [sys.executable, "-m", "cosyvoice_opt", "bench", "--model-dir", str(folder), "--precision",
               args.ours_precision, "--tokens", str(args.tokens), "--stream", "1", "--concurrency", "1",
               "--json", str(out)] + ([] if cuda else ["--device", "cpu"])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        child = _child(cmd, work / "ours.log", step_limit(last), env)
        result["children"]["ours"] = child
        result["ours"] = _read_json(out)
        if child["rc"] != 0:
            child["tail"] = _tail(child["log"])
        save()

    precisions = [p for p in args.upstream_precision.split(",") if p]
    # upstream's fastest mode, then ours, then upstream's slower modes: if the budget runs out, the pair is kept
    steps = [(f"upstream_{p}", lambda last, p=p: upstream(p, last)) for p in precisions]
    steps = steps[:1] + ([("ours", ours)] if args.ours_precision else []) + steps[1:]
    for i, (name, step) in enumerate(steps):
        if left() < 20:
            result.setdefault("skipped_for_budget", []).append(name)
            continue
        step(last=i == len(steps) - 1)
    result["wall_s"] = time.perf_counter() - t_start
    save()
    print(json.dumps(result["summary"], indent=1))
    for name, child in result["children"].items():
        if child["rc"] != 0:
            print(f"{name}: exit {child['rc']}, log {child['log']}:\n{child.get('tail', '')}", file=sys.stderr)
    return 0 if all(c["rc"] == 0 for c in result["children"].values()) else 1


def _upstream_commit(upstream_dir: Path) -> str | None:
    """The commit the kit recorded beside the exported tree (an export has no .git)."""
    for path in (upstream_dir / "COMMIT", upstream_dir.parent / "COMMIT"):
        if path.is_file():
            return path.read_text().strip()
    return None


# ---- the upstream child ------------------------------------------------------------------------------------------
def _bypass_imports(upstream_dir: Path) -> None:
    """The import-only bypasses the module docstring lists, before upstream's modules are imported."""
    import soundfile
    import torch
    import torchaudio

    matcha_dir = upstream_dir / "third_party" / "Matcha-TTS"
    sys.path[:0] = [str(upstream_dir), str(matcha_dir)]

    modelscope = types.ModuleType("modelscope")

    def snapshot_download(model_id: str, *args, **kwargs):
        raise RuntimeError(f"no downloads here: {model_id!r} is not a local folder")

    modelscope.snapshot_download = snapshot_download
    sys.modules["modelscope"] = modelscope

    import matcha

    utils = types.ModuleType("matcha.utils")
    utils.__path__ = [str(matcha_dir / "matcha" / "utils")]
    sys.modules["matcha.utils"] = utils
    matcha.utils = utils

    def load(path, *args, **kwargs):
        data, rate = soundfile.read(path, dtype="float32", always_2d=True)
        return torch.from_numpy(data.T.copy()), rate

    torchaudio.load = load

    import cosyvoice.llm.llm as upstream_llm
    import transformers

    class Qwen2FromConfig:
        @staticmethod
        def from_pretrained(path):
            return transformers.Qwen2ForCausalLM(transformers.AutoConfig.from_pretrained(path))

    upstream_llm.Qwen2ForCausalLM = Qwen2FromConfig

    import cosyvoice.transformer.upsample_encoder as encoder

    original_init = encoder.UpsampleConformerEncoder.__init__

    def init_at_own_width(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        width = self.output_size()
        if self.up_layer.channels != width:  # a tiny model; the released width is the hard-coded 512
            self.pre_lookahead_layer = encoder.PreLookaheadLayer(
                in_channels=width, channels=width, pre_lookahead_len=self.pre_lookahead_layer.pre_lookahead_len)
            self.up_layer = encoder.Upsample1D(channels=width, out_channels=width, stride=self.up_layer.stride)

    encoder.UpsampleConformerEncoder.__init__ = init_at_own_width


def _view(model_dir: Path, view_dir: Path) -> Path:
    """The folder as upstream's CosyVoice2 reads it: links to every file, the yaml with the tokenizer entries."""
    view_dir.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        link = view_dir / path.name
        if path.name != "cosyvoice2.yaml" and not link.exists():
            link.symlink_to(path.resolve())
    yaml = (model_dir / "cosyvoice2.yaml").read_text()
    if "get_tokenizer:" not in yaml:
        yaml += TOKENIZER_ENTRIES
    (view_dir / "cosyvoice2.yaml").write_text(yaml)
    return view_dir


def _model_section(yaml: str, keys: tuple[str, ...]) -> str:
    """The top-level entries `keys` of a HyperPyYAML file (each with its indented lines), in the file's order."""
    blocks: dict[str, str] = {}
    current = None
    for line in yaml.splitlines(keepends=True):
        head = re.match(r"([A-Za-z_]\w*):", line)
        if head:
            current = head.group(1)
            blocks[current] = ""
        if current is not None:
            blocks[current] += line
    missing = [k for k in keys if k not in blocks]
    if missing:
        raise ValueError(f"the yaml has no {missing}")
    return "".join(blocks[k] for k in blocks if k in keys)


def write_cv3_folder(args: argparse.Namespace) -> int:
    """A full-size CosyVoice3 folder in the released layout: upstream's modules, our seeded random weights."""
    import torch

    upstream_dir = Path(args.upstream_dir)
    _bypass_imports(upstream_dir)
    from hyperpyyaml import load_hyperpyyaml

    sys.path.append(str(REPO))
    from cosyvoice_opt.random_model import randomize_

    frontend, out = Path(args.frontend_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, target in (("CosyVoice-BlankEN", "CosyVoice-BlankEN"), ("campplus.onnx", "campplus.onnx"),
                         ("speech_tokenizer_v3.onnx", "speech_tokenizer_v3.onnx")):
        if not (out / name).exists():
            (out / name).symlink_to((frontend / target).resolve())
    yaml = _model_section((upstream_dir / CV3_EXAMPLE_YAML).read_text(), CV3_MODEL_KEYS)
    (out / "cosyvoice3.yaml").write_text(yaml)
    configs = load_hyperpyyaml(yaml, overrides={"qwen_pretrain_path": str(out / "CosyVoice-BlankEN")})
    for i, name in enumerate(("llm", "flow", "hift")):
        module = randomize_(configs[name], args.seed * 3 + i)
        torch.save(module.state_dict(), out / f"{name}.pt")
    return 0


def _map_endofprompt(tokenizer) -> None:
    """Our random tokenizer's `<|endofprompt|>` id becomes the released id that CosyVoice3LM asserts on."""
    own = tokenizer.tokenizer.convert_tokens_to_ids(ENDOFPROMPT)
    if own == ENDOFPROMPT_ID:
        return
    encode = tokenizer.encode

    def encode_released_id(text, **kwargs):
        return [ENDOFPROMPT_ID if i == own else i for i in encode(text, **kwargs)]

    tokenizer.encode = encode_released_id


def _force_tokens(llm, tokens: int) -> dict:
    """Exactly `tokens` speech tokens: every stop id is forbidden before the count, and the first is returned at it.

    Upstream's own `ignore_eos` masks one stop id (`speech_token_size`) although the loop stops on any of
    `stop_token_ids`, which random weights then sample now and again; so all of them are masked here. Returns the
    count of the last call (set when the stop is returned; None if upstream's max_len ended the call first).
    """
    sampling_ids, stops, state = llm.sampling_ids, list(llm.stop_token_ids), {"emitted": None, "llm_error": None}

    def forced(weighted_scores, decoded_tokens, sampling, ignore_eos=True):
        if len(decoded_tokens) >= tokens:
            state["emitted"] = len(decoded_tokens)
            return stops[0]
        weighted_scores[stops] = -float("inf")
        return sampling_ids(weighted_scores, decoded_tokens, sampling, ignore_eos=True)

    llm.sampling_ids = forced
    return state


def _guard_llm_thread(model, state: dict) -> None:
    """Upstream's `tts` polls for the end of its LLM thread forever if that thread raised; the guard marks the end,
    so the call returns and the error is reported instead of waiting out the budget."""
    llm_job = model.llm_job

    def guarded(*args):
        try:
            llm_job(*args)
        except BaseException as e:
            state["llm_error"] = e
            model.llm_end_dict[args[-1]] = True  # the last argument is the call's uuid
            raise

    model.llm_job = guarded


class _StageTimer:
    """Wall time inside the frontend, the LLM thread, the flow and HiFT calls of one synthesis call."""

    def __init__(self, tts, sync) -> None:
        self.tts, self.sync, self.totals, self.patched = tts, sync, {}, []

    def wrap(self, owner, name: str, stage: str, synchronize: bool) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if synchronize:
                self.sync()
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            if synchronize:
                self.sync()
            self.totals[stage] = self.totals.get(stage, 0.0) + time.perf_counter() - t0
            return out

        setattr(owner, name, timed)
        self.patched.append((owner, name, original))

    def __enter__(self) -> _StageTimer:
        model = self.tts.model
        self.wrap(self.tts.frontend, "frontend_zero_shot", "frontend", False)
        self.wrap(model, "llm_job", "llm", False)  # the LLM thread's whole life: prefill and every decode step
        self.wrap(model.flow, "inference", "flow", True)
        self.wrap(model.hift, "inference", "hift", True)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in self.patched:
            setattr(owner, name, original)


def _synthesise(tts, workload: dict, reset_hop: bool, state: dict) -> dict:
    state["emitted"] = state["llm_error"] = None
    if reset_hop:
        tts.model.token_hop_len = HOP_LEN
    t0 = time.perf_counter()
    chunks = []
    for out in tts.inference_zero_shot(workload["text"], workload["prompt_text"], workload["prompt_wav"],
                                       stream=True):
        chunks.append((time.perf_counter() - t0, out["tts_speech"].shape[1]))
    if state["llm_error"] is not None:
        raise RuntimeError("upstream's LLM thread failed") from state["llm_error"]
    total = chunks[-1][0]
    audio = sum(n for _, n in chunks) / tts.sample_rate
    return {"first_packet_s": chunks[0][0], "total_s": total, "audio_s": audio, "rtf": total / audio,
            "tokens": state["emitted"], "chunks": [{"t_s": t, "samples": n} for t, n in chunks]}


def upstream_child(args: argparse.Namespace) -> int:
    import torch

    _bypass_imports(Path(args.upstream_dir))
    from cosyvoice.cli.cosyvoice import CosyVoice2, CosyVoice3

    workload = json.loads(args.workload)
    result: dict = {"family": args.family, "precision": args.precision, "tokens": args.tokens, "runs": []}

    def save() -> None:
        _write_json(args.json, result)

    cuda = torch.cuda.is_available()
    if args.precision == "fp16" and not cuda:
        raise SystemExit("upstream's fp16 mode needs a GPU (CosyVoice2 turns it off on CPU)")
    t0 = time.perf_counter()
    if args.family == "cosyvoice2":
        tts = CosyVoice2(str(_view(Path(args.model_dir), Path(args.view_dir))), fp16=args.precision == "fp16")
    else:
        tts = CosyVoice3(args.model_dir, fp16=args.precision == "fp16")
        _map_endofprompt(tts.frontend.tokenizer)
        workload = workload | {"prompt_text": CV3_SYSTEM_PROMPT + workload["prompt_text"]}
    result["load_s"] = time.perf_counter() - t0
    result["workload"] = workload
    text_tokens = len(tts.frontend.tokenizer.encode(workload["text"], allowed_special=tts.frontend.allowed_special))
    if 20 * text_tokens < args.tokens:
        raise SystemExit(f"the text has {text_tokens} tokens: upstream's max_len (20 per text token) is below "
                         f"{args.tokens}")
    state = _force_tokens(tts.model.llm, args.tokens)
    _guard_llm_thread(tts.model, state)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    result["warmup"] = _synthesise(tts, workload, reset_hop=True, state=state)
    save()
    for _ in range(args.runs):
        result["runs"].append(_synthesise(tts, workload, reset_hop=True, state=state))
        runs = result["runs"]
        result["first_packet_p50_ms"] = 1000 * statistics.median(r["first_packet_s"] for r in runs)
        result["rtf_p50"] = statistics.median(r["rtf"] for r in runs)
        result["tokens_ok"] = all(r["tokens"] == args.tokens for r in runs)
        save()
    # the hop as the calls before left it (100)
    result["as_served"] = _synthesise(tts, workload, reset_hop=False, state=state)
    save()
    with _StageTimer(tts, sync) as timer:
        result["staged_run"] = _synthesise(tts, workload, reset_hop=True, state=state)
    result["stage_s"] = timer.totals
    result["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    expected = args.tokens * tts.model.flow.token_mel_ratio * 480 / tts.sample_rate  # 24 kHz: 480 samples a frame
    result["audio_s_expected"] = expected
    save()
    return 0


# ---- command line ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_write_cv3"]:
        p = argparse.ArgumentParser(prog="upstream_compare.py _write_cv3")
        for name in ("--upstream-dir", "--frontend-dir", "--out-dir"):
            p.add_argument(name, required=True)
        p.add_argument("--seed", type=int, required=True)
        return write_cv3_folder(p.parse_args(argv[1:]))
    if argv[:1] == ["_upstream"]:
        p = argparse.ArgumentParser(prog="upstream_compare.py _upstream")
        for name in ("--upstream-dir", "--model-dir", "--view-dir", "--family", "--precision", "--workload", "--json"):
            p.add_argument(name, required=True)
        p.add_argument("--tokens", type=int, required=True)
        p.add_argument("--runs", type=int, required=True)
        return upstream_child(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream-dir", required=True, help="FunAudioLLM/CosyVoice checkout with Matcha-TTS inside")
    p.add_argument("--upstream-pythonpath", default=None,
                   help="packages upstream needs, for its child only (default: $UPSTREAM_PYTHONPATH)")
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--model-dir", help="a model folder in the released layout (default: write a random one)")
    p.add_argument("--family", choices=("cosyvoice2", "cosyvoice3"), default="cosyvoice2", help="model family")
    p.add_argument("--size", choices=("full", "tiny"), default="full",
                   help="random model size (cosyvoice3: full, upstream's example yaml)")
    p.add_argument("--seed", type=int, default=0, help="random model seed")
    p.add_argument("--work-dir", help="random folder, prompt, logs and the children's JSON (default: a temp dir)")
    p.add_argument("--tokens", type=int, default=250, help="speech tokens per call, both sides")
    p.add_argument("--runs", type=int, default=3, help="measured upstream calls per precision")
    p.add_argument("--upstream-precision", default="fp32,fp16", help="comma list of fp32|fp16, fastest first")
    p.add_argument("--ours-precision", default="bf16", help="comma list for our bench --precision ('' leaves ours out)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock budget: a step is skipped, or a child stopped, when it runs out")
    p.add_argument("--step-s", type=float, default=240.0,
                   help="the most one child may take, but the last (upstream's slower mode), which gets what is left")
    args = p.parse_args(argv)
    if args.model_dir and args.size == "tiny":
        p.error("--size picks the random model; with --model-dir, leave it out")
    if args.family == "cosyvoice3" and args.size == "tiny":
        p.error("a random CosyVoice3 folder is full size (upstream's example yaml)")
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
