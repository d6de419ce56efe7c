"""CosyVoice3Model.tts end to end against upstream on every CosyVoice3 fixture set (`model_tts_io.pt`): the stub
LLM's tokens through the silent-token rule, the streaming schedule's DiT flow calls, CausalHiFT streaming each call's
new mel (stream), one final call (non-stream), and a speed change (non-stream)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from cosyvoice_opt.config import FlowDiTConfig
from cosyvoice_opt.engine.streaming import HopSchedule, StreamConfig, change_speed, stream_calls
from cosyvoice_opt.models.flow_dit import FlowDiT
from cosyvoice_opt.models.silent_tokens import drop_long_silences
from tests.conftest import fixture_params
from tests.test_causal_hift import load_set as load_hift
from tests.tolerances import CFM_PEAK, CV3_AUDIO, EXACT, assert_close

SETS = fixture_params("parity-cv3")


@functools.cache
def load(folder: Path) -> tuple[dict, StreamConfig, dict, FlowDiT, dict]:
    cfg = json.loads((folder / "model_tts_config.json").read_text())
    fcfg = json.loads((folder / "flow_tiny_config.json").read_text())
    flow = FlowDiT(FlowDiTConfig.from_upstream(fcfg["flow"], fcfg["pre_lookahead_layer"], fcfg["decoder"],
                                               fcfg["estimator"], fcfg["n_timesteps"])).eval()
    flow.load_state_dict(torch.load(folder / "flow_tiny_state_dict.pt", weights_only=True), strict=True)
    io = torch.load(folder / "model_tts_io.pt", weights_only=True)
    return cfg, StreamConfig.from_upstream(cfg), io, flow, torch.load(folder / "flow_io.pt", weights_only=True)


def flow_tokens(cfg: dict, io: dict) -> torch.Tensor:
    """What upstream's llm_job hands the flow: the LLM's tokens without long silent runs."""
    kept = drop_long_silences(io["llm_tokens"][0].tolist(), cfg["silent_tokens"], cfg["max_silent_token_num"])
    return torch.tensor([kept], dtype=io["llm_tokens"].dtype)


@pytest.mark.parametrize("folder", SETS)
def test_schedule_and_lengths(folder):
    """Upstream's calls (the CosyVoice2 schedule), HiFT's growing input and the samples each call yields."""
    cfg, sc, io, _, fio = load(folder)
    tokens = flow_tokens(cfg, io)
    assert_close(tokens, io["tokens"], EXACT)
    calls = stream_calls(fio["prompt_token"].shape[1], tokens.shape[1], sc)
    assert [(c.n_tokens_in, c.token_offset, c.streaming, c.finalize) for c in calls] == [
        (c["n_tokens_in"], c["token_offset"], c["streaming"], c["finalize"]) for c in cfg["stream"]["calls"]
    ]
    mel_frames = [sc.token_mel_ratio * (c.n_tokens_in - (0 if c.finalize else sc.pre_lookahead_len)) for c in calls]
    assert mel_frames == cfg["stream"]["hift_mel_in_frames"]
    assert [c.shape[-1] for c in io["stream_speech_chunks"]] == cfg["stream"]["yielded_samples"]


def close_mel(got: torch.Tensor, want: torch.Tensor) -> None:
    """The flow's mel: a 10-step solve in float32 (test_flow_dit's bound)."""
    assert_close(got, want, CFM_PEAK)


def close_audio(got: torch.Tensor, want: torch.Tensor) -> None:
    """Audio from our flow's mel, through f0, which amplifies the mel's rounding (tests/tolerances.py)."""
    assert_close(got, want, CV3_AUDIO)


@pytest.mark.parametrize("folder", SETS)
@torch.inference_mode()
def test_stream(folder):
    """Each streaming call: the flow's new frames are upstream's HiFT input's new frames, and one CausalHiFT stream
    fed them yields upstream's chunk."""
    cfg, sc, io, flow, fio = load(folder)
    hift, _ = load_hift(folder)
    tokens, prompt = flow_tokens(cfg, io), fio["prompt_token"]
    calls = stream_calls(prompt.shape[1], tokens.shape[1], sc)
    state, done = hift.new_stream(), 0
    upstream = io["stream_hift_calls"]
    for call, hift_call, want in zip(calls, upstream, io["stream_speech_chunks"], strict=True):
        mel = flow.inference(tokens[:, : call.n_tokens_in], prompt, fio["prompt_feat"], fio["embedding"],
                             streaming=call.streaming, finalize=call.finalize)[:, :, call.mel_offset:]
        close_mel(mel, hift_call["mel_in"][..., done:])
        done = hift_call["mel_in"].shape[-1]
        close_audio(hift.stream(state, mel, call.finalize), want)
    assert state.finished
    assert sum(c.shape[-1] for c in io["stream_speech_chunks"]) == done * hift.cfg.upsample_scale


@pytest.mark.parametrize("folder", SETS)
@pytest.mark.parametrize("mode", ["nonstream", "nonstream_speed"])
@torch.inference_mode()
def test_nonstream(folder, mode):
    """One final flow call on all tokens and one final HiFT call, with upstream's speed change (after the flow)."""
    cfg, sc, io, flow, fio = load(folder)
    hift, _ = load_hift(folder)
    tokens, prompt = flow_tokens(cfg, io), fio["prompt_token"]
    call = HopSchedule(prompt.shape[1], sc).final_call(tokens.shape[1])
    mel = flow.inference(tokens, prompt, fio["prompt_feat"], fio["embedding"], streaming=call.streaming,
                         finalize=call.finalize)
    if mode == "nonstream_speed":
        mel = change_speed(mel, float(io["speed"]))
    (hift_call,), (want,) = io[f"{mode}_hift_calls"], io[f"{mode}_speech_chunks"]
    assert mel.shape[-1] == cfg[mode]["hift_mel_in_frames"][0]
    close_mel(mel, hift_call["mel_in"])
    close_audio(hift.inference(mel, finalize=True)[0], want)
