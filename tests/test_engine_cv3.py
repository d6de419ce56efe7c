"""CosyVoice3 through the one engine (CPU, tiny): a random CosyVoice3 folder loads strictly and is served end to end,
voices of the other family without audio are refused, and the engine's vocoder path (the family's silent-token rule,
schedule and CausalHiFT stream) gives upstream's `CosyVoice3Model.tts` audio for every parity set's inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_opt import checkpoint
from cosyvoice_opt.__main__ import main as cli_main
from cosyvoice_opt.config import Family, LLMConfig, ModelConfig
from cosyvoice_opt.engine import Engine, EngineConfig, flow_runner
from cosyvoice_opt.engine.audio_worker import AudioWorker
from cosyvoice_opt.engine.family import CosyVoice2Family, CosyVoice3Family, ModelFamily
from cosyvoice_opt.engine.flow_runner import FlowRunner
from cosyvoice_opt.engine.precision import FallbackCounter, PrecisionPolicy
from cosyvoice_opt.engine.scheduler import FlowPrompt, Request, TextPiece
from cosyvoice_opt.engine.streaming import StreamConfig
from cosyvoice_opt.errors import CheckpointError, InputError
from cosyvoice_opt.frontend.voices import VoiceStore
from cosyvoice_opt.models.causal_hift import CausalHiFT
from cosyvoice_opt.models.flow_dit import FlowDiT
from cosyvoice_opt.models.silent_tokens import MAX_SILENT_RUN, SILENT_TOKENS
from cosyvoice_opt.random_model import write_random_model_folder, write_random_tokenizer_folder
from cosyvoice_opt.types import SynthesisRequest
from tests.conftest import fixture_params
from tests.test_causal_hift import build as build_hift
from tests.test_flow_dit import _load as load_flow

SETS = fixture_params("parity-cv3")
SR = 16000
FRAME = 480  # output samples per mel frame


def prompt_wav(seconds: float = 3.3) -> tuple[int, np.ndarray]:
    t = np.arange(int(SR * seconds)) / SR
    return SR, (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


@pytest.fixture(scope="module")
def cv3_folder(tmp_path_factory) -> Path:
    """Written by the command line (`random-model DIR --family cosyvoice3`), named after the other family."""
    folder = tmp_path_factory.mktemp("cv3") / "CosyVoice2-0.5B"
    assert cli_main(["random-model", str(folder), "--family", "cosyvoice3", "--size", "tiny"]) == 0
    return folder


@pytest.fixture(scope="module")
def cv2_folder(tmp_path_factory) -> Path:
    return write_random_model_folder(tmp_path_factory.mktemp("cv2") / "CosyVoice2-0.5B", "tiny", 0)


@pytest.fixture(scope="module")
def engine(cv3_folder, tmp_path_factory):
    e = Engine.from_model_dir(cv3_folder, EngineConfig(device="cpu", warmup=False,
                                                       voices_dir=str(tmp_path_factory.mktemp("voices"))))
    yield e
    e.close()


# ---- the folder -----------------------------------------------------------------------------------------------
def test_random_folder_is_a_cosyvoice3_folder_loaded_strictly(cv3_folder):
    """The folder holds CosyVoice3's files (and none of CosyVoice2's), its yaml gives back the tiny config, and the
    three networks are the CosyVoice3 ones with the saved weights."""
    assert checkpoint.detect_family(cv3_folder) == Family.COSYVOICE3
    assert not checkpoint.missing_files(cv3_folder, Family.COSYVOICE3)
    assert not (cv3_folder / "cosyvoice2.yaml").exists() and not (cv3_folder / "speech_tokenizer_v2.onnx").exists()
    model = checkpoint.load_model(cv3_folder)
    assert model.family == Family.COSYVOICE3
    assert model.config == ModelConfig.tiny(Family.COSYVOICE3)
    assert model.config.feat.fmax is None  # CosyVoice3's prompt mel
    assert isinstance(model.flow, FlowDiT) and isinstance(model.hift, CausalHiFT)
    assert model.speech_tokenizer_path.name == "speech_tokenizer_v3.onnx"
    for name, module in model.parts().items():
        saved = torch.load(cv3_folder / f"{name}.pt", weights_only=True)
        for key, value in module.state_dict().items():
            assert torch.equal(value, saved[key]), (name, key)


def test_check_model_names_the_family(cv3_folder, cv2_folder, capsys):
    assert cli_main(["check-model", "--model-dir", str(cv3_folder)]) == 0
    assert "family: CosyVoice3" in capsys.readouterr().out.splitlines()
    assert cli_main(["check-model", "--model-dir", str(cv2_folder)]) == 0
    assert "family: CosyVoice2" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("name", ["llm.pt", "flow.pt", "hift.pt"])
def test_a_cosyvoice2_network_in_a_cosyvoice3_folder_is_one_error_naming_it(name, cv3_folder, cv2_folder, tmp_path):
    folder = tmp_path / "mixed"
    shutil.copytree(cv3_folder, folder)
    shutil.copy(cv2_folder / name, folder / name)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load_model(folder)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{name}:")
    assert "CosyVoice2 network" in message and "CosyVoice3" in message


def test_a_cosyvoice3_network_in_a_cosyvoice2_folder_is_one_error_naming_it(cv3_folder, cv2_folder, tmp_path):
    folder = tmp_path / "mixed"
    shutil.copytree(cv2_folder, folder)
    shutil.copy(cv3_folder / "flow.pt", folder / "flow.pt")
    with pytest.raises(CheckpointError, match=r"^flow\.pt: holds a CosyVoice3 network, but the folder is CosyVoice2"):
        checkpoint.load_model(folder)


def test_a_wrong_key_in_a_cosyvoice3_file_is_one_error_naming_it(cv3_folder, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(cv3_folder, folder)
    sd = torch.load(folder / "hift.pt", weights_only=True)
    sd.pop("conv_post.bias")
    torch.save(sd, folder / "hift.pt")
    with pytest.raises(CheckpointError, match=r"^hift\.pt: does not match the model: 1 missing key\(s\) e\.g\. "
                                              r"conv_post\.bias$"):
        checkpoint.load_model(folder)


def test_a_missing_file_names_cosyvoice3s(cv3_folder, tmp_path):
    folder = tmp_path / "incomplete"
    shutil.copytree(cv3_folder, folder)
    (folder / "speech_tokenizer_v3.onnx").unlink()
    with pytest.raises(CheckpointError, match="CosyVoice3 model folder .* lacks speech_tokenizer_v3.onnx"):
        checkpoint.load_model(folder)


def test_a_tokenizer_without_the_released_ids_is_refused_at_load_naming_it(cv3_folder, tmp_path):
    """CosyVoice3's LLM finds `<|endofprompt|>` by its released id: a tokenizer folder whose vocabulary puts it
    elsewhere (one not released with the model) is one load error naming the folder, not a failure of every
    request."""
    folder = tmp_path / "other-tokenizer"
    shutil.copytree(cv3_folder, folder)
    write_random_tokenizer_folder(folder / "CosyVoice-BlankEN", 2048, family=Family.COSYVOICE3)
    with pytest.raises(CheckpointError, match=r"CosyVoice-BlankEN/ in .*: <\|endofprompt\|> is id \d+, but the "
                                              r"cosyvoice3 LLM finds it by id 151646"):
        Engine.from_model_dir(folder, EngineConfig(device="cpu", warmup=False, voices_dir=str(tmp_path / "v")))


# ---- the family -----------------------------------------------------------------------------------------------
def test_family_objects():
    """The engine's family object follows the config: the stop rule of each LLM, CosyVoice3's silent-token rule,
    the flow runner (paged for both, over what each flow caches) and the vocoder states."""
    v2, v3 = ModelFamily.for_model(ModelConfig.tiny()), ModelFamily.for_model(ModelConfig.tiny(Family.COSYVOICE3))
    assert isinstance(v2, CosyVoice2Family) and isinstance(v3, CosyVoice3Family)
    assert v2.stop_token_ids == (6561, 6562, 6563) and v3.stop_token_ids == tuple(range(6561, 6761))
    assert v2.min_len_masked_ids == v3.min_len_masked_ids == range(6561, 6562)  # upstream's (a quirk in v3)
    assert v2.token_filter() is None
    keep = v3.token_filter()
    run = [SILENT_TOKENS[0]] * (MAX_SILENT_RUN + 3) + [100] + [SILENT_TOKENS[1]] * 2
    assert [t for t in run if keep(t)] == [SILENT_TOKENS[0]] * MAX_SILENT_RUN + [100] + [SILENT_TOKENS[1]] * 2
    assert v2.hift_shapes(8, None)
    flow = FlowDiT(ModelConfig.tiny(Family.COSYVOICE3).flow)
    runner = v3.flow_runner(flow, lambda: (4, 2), False)
    assert isinstance(runner, FlowRunner) and runner.flow is flow and runner.pool.num_pages == 4
    est = flow.cfg.estimator  # the DiT's K|V rows after RoPE; no encoder K/V, only the pre-lookahead conv
    assert (runner.pool.n_attn, runner.pool.width) == (est.depth, 2 * est.inner_dim)
    assert runner.encoder_pool.rows_per_page == 0 and len(runner.encoder_pool.conv_shapes) == 1
    # a page holds what an eager stream keeps of one chunk's tokens (the DiT's K/V in both)
    assert FlowRunner.bytes_per_page(flow, torch.bfloat16) == flow.stream_bytes_per_token(2) * flow.chunk_tokens


# ---- the engine -----------------------------------------------------------------------------------------------
def test_engine_serves_cosyvoice3_streamed_and_whole(engine):
    """Zero-shot through the engine: a stream in several chunks whose lengths follow the schedule and CausalHiFT's
    8-frame hold-back, and a whole clip of the same length; both finite and not silent."""
    assert engine.info["family"] == "cosyvoice3" and engine.info["family_name"] == "CosyVoice3"
    assert engine.family.name == "CosyVoice3"
    req = SynthesisRequest(text="Hello world, this is a test.", prompt_audio=prompt_wav(), prompt_text="a prompt",
                           seed=3, force_tokens=150)
    chunks = list(engine.stream(req))
    one = engine.synthesize(req)
    assert [c.index for c in chunks] == list(range(len(chunks))) and chunks[-1].is_last
    total = sum(len(c.pcm) for c in chunks)
    assert total == len(one.pcm) and total % (2 * FRAME) == 0 and total <= 150 * 2 * FRAME
    assert len(chunks) >= 3
    # the first chunk: the first hop (25 tokens + the pad to the 25-token grid, prompt included) less CausalHiFT's
    # 8 held-back frames; the second: the next hop's (50 tokens) frames
    n_prompt = engine.prompt_features(prompt_wav()).speech_tokens.shape[1]
    assert len(chunks[0].pcm) == (2 * (25 + -n_prompt % 25) - 8) * FRAME
    assert len(chunks[1].pcm) == 2 * 50 * FRAME
    for c in (*chunks, one):
        assert np.abs(c.pcm.astype(np.float64)).max() > 0


def test_engine_saved_voice_and_other_familys_voice(engine, tmp_path):
    """A voice saved on the CosyVoice3 engine records its family and serves; a CosyVoice2 voice saved without its
    audio in the same folder is refused with a message naming both families (tests/test_voices_families.py: voices
    with audio speak with both)."""
    engine.save_voice("v3 voice", prompt_wav(), "a prompt")
    meta = json.loads(next(Path(engine.voices.folder).glob("v3 voice*.json")).read_text())
    assert meta["family"] == "cosyvoice3"
    audio = engine.synthesize(SynthesisRequest(text="Hello there.", voice="v3 voice", mode="zero_shot",
                                               force_tokens=40, stream=False))
    assert len(audio.pcm) == 40 * 2 * FRAME
    other = VoiceStore(engine.voices.folder, family=Family.COSYVOICE2)
    other.save("v2 voice", engine.voices.load("v3 voice").features, {"prompt_text": "a prompt"})
    with pytest.raises(InputError, match="CosyVoice2 model.*CosyVoice3"):
        engine.synthesize(SynthesisRequest(text="Hello there.", voice="v2 voice", mode="zero_shot", force_tokens=40))


def test_engine_config_family_is_checked():
    with pytest.raises(InputError, match="family must be one of cosyvoice2, cosyvoice3"):
        EngineConfig(random_size="tiny", family="cosyvoice4")


# ---- parity with upstream's CosyVoice3Model.tts ---------------------------------------------------------------
def _vocoder_run(folder: Path, stream: bool, speed: float = 1.0) -> tuple[list[np.ndarray], dict]:
    """The set's LLM token stream (silent runs included) as one finished text piece through the engine's vocoder
    with the CosyVoice3 family, the set's flow and HiFT and its streaming constants -> the int16 chunks."""
    sc_json = json.loads((folder / "model_tts_config.json").read_text())
    assert tuple(sc_json["silent_tokens"]) == SILENT_TOKENS and sc_json["max_silent_token_num"] == MAX_SILENT_RUN
    io = torch.load(folder / "model_tts_io.pt", weights_only=True)
    flow, _, fio = load_flow(folder)
    hift = build_hift(folder)
    family = CosyVoice3Family(ModelConfig(llm=LLMConfig(family="cosyvoice3"), flow=flow.cfg, hift=hift.cfg),
                              StreamConfig.from_upstream(sc_json))
    policy = PrecisionPolicy.resolve("fp32", torch.device("cpu"))
    voc = AudioWorker(flow, hift.fuse_weight_norm(), policy, FallbackCounter(), 24000, family=family)
    tokens = io["llm_tokens"][0].tolist()
    piece = TextPiece(torch.arange(4), None, 0, len(tokens), tokens=tokens, done=True)
    prompt = FlowPrompt(fio["prompt_token"], fio["prompt_feat"], fio["embedding"])
    req = Request([piece], prompt, stream=stream, speed=speed, seed=0, force_tokens=None, arrival=0.0,
                  frontend_s=0.0)
    voc.start(lambda r, ok: None)
    chunks = []
    try:
        voc.add(req)
        while not chunks or not chunks[-1].is_last:
            chunks.append(req.out.get(timeout=300))
    finally:
        voc.stop()
    return [c.pcm for c in chunks], io


def _pcm(wave: torch.Tensor) -> np.ndarray:
    return (wave.clamp(-1, 1) * 32767).round()[0].numpy()


def _close_pcm(got: np.ndarray, want: np.ndarray) -> None:
    """int16 audio against upstream's float audio, scaled to its peak. The excitation integrates f0 over the
    utterance, so the flow's float re-association (~4e-6 in the mel) grows to ~5e-3 of the peak at the end of a clip
    (the same mel through CausalHiFT stays within ~1e-5: tests/test_causal_hift.py); one rounding step on top."""
    assert got.shape == want.shape
    assert np.abs(got.astype(np.float64) - want).max() <= 1 + 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("folder", SETS)
@pytest.mark.parametrize("speed", [None, 1.0])
def test_engine_whole_clip_is_upstreams_cosyvoice3_tts(folder, speed):
    """Non-streaming `tts` (speed 1 and the set's speed): the silent runs past the 5th token are dropped before the
    flow, the full-attention flow, the speed change, CausalHiFT over the whole mel."""
    io = torch.load(folder / "model_tts_io.pt", weights_only=True)
    speed = float(io["speed"]) if speed is None else speed
    got, io = _vocoder_run(folder, stream=False, speed=speed)
    key = "nonstream_speech_chunks" if speed == 1.0 else "nonstream_speed_speech_chunks"
    assert len(got) == 1
    _close_pcm(got[0], _pcm(torch.cat(io[key], dim=-1)))


@pytest.mark.parametrize("folder", SETS)
def test_engine_stream_is_upstreams_cosyvoice3_tts(folder):
    """Streaming `tts`: as many chunks as upstream's, of its lengths (the schedule, the silent-token rule and the
    8-frame hold-back); every non-final chunk equals upstream's. The last one differs by design: the engine's final
    flow chunk stays block-causal (models/flow.py), upstream's attends to everything."""
    got, io = _vocoder_run(folder, stream=True)
    want = io["stream_speech_chunks"]
    assert [len(g) for g in got] == [w.shape[-1] for w in want]
    for g, w in zip(got[:-1], want[:-1], strict=True):
        _close_pcm(g, _pcm(w))


# ---- the stop rule in the engine's sampler --------------------------------------------------------------------
@pytest.mark.parametrize("fixed", [False, True])
def test_engine_sampler_masks_the_familys_min_len_ids(fixed):
    """Below min_len the engine's batched sampler masks the family's `min_len_masked_ids`: upstream's id 6561
    (CosyVoice3's sos, a quirk), so 6562 can still end a CosyVoice3 utterance early; with the opt-in fix, every
    stop id is masked. One row whose mass is on 6561 and 6562 only, another past min_len."""
    from cosyvoice_opt.engine.llm_runner import MIN_LEN, RECENT, STEP, LLMRunner
    from cosyvoice_opt.models.llm import SpeechLLM

    cfg = LLMConfig(qwen2=ModelConfig.tiny().llm.qwen2, family="cosyvoice3", min_len_masks_all_stops=fixed)
    runner = LLMRunner(SpeechLLM(cfg).eval(), 2, 64, torch.float32, torch.device("cpu"), cuda_graphs=False)
    logp = torch.full((2, cfg.num_speech_rows), float("-inf"))
    logp[:, 6561] = logp[:, 6562] = logp[:, 7] = float(np.log(1 / 3))
    state = torch.zeros(2, RECENT + cfg.sampling.win_size, dtype=torch.long)
    state[:, RECENT:] = -1
    state[:, MIN_LEN] = 10
    state[1, STEP] = 10  # at min_len: nothing masked
    seen = [set(), set()]
    for u in torch.linspace(0.01, 0.99, 15):
        tok = runner._sample_and_advance(logp, state.clone(), None, torch.tensor([[u, u], [u, u]]))
        for row in range(2):
            seen[row].add(int(tok[row]))
    assert seen[0] == ({7} if fixed else {6562, 7})
    assert seen[1] == {6561, 6562, 7}


# ---- the UI and the API name the family -----------------------------------------------------------------------
def test_banner_and_models_name_the_family(engine):
    import argparse

    import httpx

    from cosyvoice_opt.bench.loopback import serve_in_process
    from cosyvoice_opt.webui.layout import banner

    assert banner(engine, argparse.Namespace(random=None), None).startswith("# CosyVoice3 · cosyvoice-opt")
    with serve_in_process(engine, None) as url:
        models = httpx.get(f"{url}/v1/models", timeout=60).json()["data"]
    assert models[0]["id"] == Path(engine.info["model"]).name
    assert {m["family"] for m in models} == {"cosyvoice3"}


def test_ui_offers_cosyvoice3s_instruction_presets(engine):
    from cosyvoice_opt import webui
    from cosyvoice_opt.frontend.instructions import INSTRUCTIONS
    from cosyvoice_opt.monitor import Monitor

    args = webui.parse_args(["--concurrency", "4", "--host", "127.0.0.1"])
    monitor = Monitor(interval=0.5)
    demo = webui.build_app(engine, args, monitor)
    try:
        presets = [c for c in demo.config["components"] if c.get("props", {}).get("elem_id") == "instruct2_presets"]
    finally:
        demo.close()
    assert len(presets) == 1
    assert [value for _, value in presets[0]["props"]["choices"]] == [i.text for i in INSTRUCTIONS]


def test_family_flag_reaches_the_engine_config():
    """`--family` beside `--random`: the serve, synth and bench parsers take it (CosyVoice2 by default), and a
    cluster's replicas and page get it."""
    from cosyvoice_opt import webui
    from cosyvoice_opt.bench.cli import parse_args as bench_args
    from cosyvoice_opt.cluster.settings import ClusterSettings

    assert webui.parse_args(["--random", "tiny"]).family == "cosyvoice2"
    assert webui.parse_args(["--random", "tiny", "--family", "cosyvoice3"]).family == "cosyvoice3"
    assert bench_args(["--random", "tiny", "--family", "cosyvoice3"]).family == "cosyvoice3"
    with pytest.raises(SystemExit):
        webui.parse_args(["--random", "tiny", "--family", "cosyvoice1"])
    settings = ClusterSettings(random="tiny", family="cosyvoice3")
    assert settings.engine_config(cpu=True).family == "cosyvoice3"
    assert settings.webui_flags()[-4:] == ["--random", "tiny", "--family", "cosyvoice3"]
    assert ClusterSettings().engine_config(cpu=True).family == "cosyvoice2"


def test_cosyvoice3_flow_chunks_run_paged(engine):
    """CosyVoice3's DiT chunks run through the paged flow runner, as CosyVoice2's: admission counts its slots and
    pages, a streamed request's chunks are paged flow calls, and its pages come back when it ends."""
    runner = engine._parts.vocoder.flow_runner
    assert isinstance(runner, FlowRunner) and isinstance(runner.flow, FlowDiT)
    before = engine.stats()
    assert before["max_streams"] == runner.pool.num_slots - runner.max_prefixes
    assert before["flow_pages"] == runner.pool.num_pages > 0
    req = SynthesisRequest(text="Hello world, this is a test.", prompt_audio=prompt_wav(), prompt_text="a prompt",
                           seed=5, force_tokens=120)
    chunks = list(engine.stream(req))
    after = engine.stats()
    assert len(chunks) >= 3 and after["flow_calls"] - before["flow_calls"] >= len(chunks) - 1
    cached = {page for entry in runner._prefixes.values() for page in entry.pages}  # a voice seen before: its prefix
    assert after["flow_pages_used"] == len(cached)  # the stream's own pages came back


@pytest.mark.gpu  # CUDA graphs
def test_cosyvoice3_flow_graphs_are_captured_at_start_and_replayed_while_serving(tmp_path, monkeypatch):
    """On CUDA a CosyVoice3 engine captures the flow graph (encoder and Euler step) of every shape of the ladder at
    start-up, and serving streamed requests of one voice (seen again: its prompt prefix computed and cached, then
    adopted) replays them: no capture, no call outside the set, every paged call's encoder and steps from captured
    graphs."""
    calls = []
    encode, run = flow_runner._CfmGraph.encode, flow_runner._CfmGraph.run
    monkeypatch.setattr(flow_runner._CfmGraph, "encode",
                        lambda self, *a: calls.append(self.encoder_graph is not None) or encode(self, *a))
    monkeypatch.setattr(flow_runner._CfmGraph, "run",
                        lambda self, *a: calls.append(self.graph is not None) or run(self, *a))
    config = EngineConfig(random_size="tiny", family="cosyvoice3", device="cuda", voices_dir=str(tmp_path))
    with Engine.from_model_dir(None, config) as e:
        runner = e._parts.vocoder.flow_runner
        start = e.stats()
        assert isinstance(runner.flow, FlowDiT)
        assert start["flow_graph_captures"] == len(runner.graphs.entries) == len(runner.graph_keys()) > 0
        calls.clear()  # the warm-up's
        for seed in (3, 4, 5):
            req = SynthesisRequest(text="Hello world, this is a test.", prompt_audio=prompt_wav(),
                                   prompt_text="a prompt", seed=seed, force_tokens=150)
            chunks = list(e.stream(req))
            assert len(chunks) >= 3 and all(np.isfinite(c.pcm.astype(np.float64)).all() for c in chunks)
        stats = e.stats()
        assert stats["flow_calls"] > start["flow_calls"] and calls and all(calls), calls
        assert stats["flow_prefix_hits"] > start["flow_prefix_hits"]
        assert stats["flow_graph_captures"] == start["flow_graph_captures"]  # none captured while serving
        assert stats["flow_graph_misses"] == 0


def test_random_cosyvoice3_engine_warms_up_and_serves(tmp_path):
    """`--random tiny --family cosyvoice3`: the built-in random model of that family, warmed up (its warm-up text
    carries the <|endofprompt|> CosyVoice3's LLM requires) and serving a cross-lingual request."""
    config = EngineConfig(random_size="tiny", family="cosyvoice3", device="cpu", voices_dir=str(tmp_path))
    with Engine.from_model_dir(None, config) as e:
        assert e.info["model"] == "random cosyvoice3 tiny" and e.family.family == Family.COSYVOICE3
        assert e.startup_s["warmup"] > 0
        clip = e.synthesize(SynthesisRequest(text="Hello.", mode="cross_lingual", prompt_audio=prompt_wav(),
                                             force_tokens=30, stream=False))
        assert len(clip.pcm) == 30 * 2 * FRAME


def test_builtin_voices_serve_cosyvoice3(engine):
    """A built-in voice is prompt audio and its transcript: its features come from this family's tokenizer."""
    names = engine.voices.builtin_names()
    assert names
    clip = engine.synthesize(SynthesisRequest(text="Hello there.", voice=names[0], mode="zero_shot",
                                              force_tokens=30, stream=False))
    assert len(clip.pcm) == 30 * 2 * FRAME


def test_streamed_text_through_a_cosyvoice3_engine(engine):
    """Text that arrives word by word (bidirectional streaming) on CosyVoice3: the LLM takes it in cycles and the
    audio streams, at least the forced length (upstream's `inference_bistream` raises on CosyVoice3's specials)."""
    text = "Hello world, this is a streamed text that arrives word by word."

    def words():
        yield from (w + " " for w in text.split(" "))

    req = SynthesisRequest(text=words(), prompt_audio=prompt_wav(), prompt_text="a prompt", stream=True,
                           force_tokens=120)
    chunks = list(engine.stream(req))
    total = sum(len(c.pcm) for c in chunks)
    assert len(chunks) >= 3 and chunks[-1].is_last
    assert total % (2 * FRAME) == 0 and total >= 120 * 2 * FRAME
