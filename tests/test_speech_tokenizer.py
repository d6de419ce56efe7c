"""The speech tokenizer in PyTorch (`models.speech_tokenizer`, read by `speech_tokenizer_weights`, served by
`engine.torch_speech_tokenizer`) against onnxruntime on the same files of the released network."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from cosyvoice_opt.engine import Engine, EngineConfig, torch_speech_tokenizer
from cosyvoice_opt.engine.torch_speech_tokenizer import GRAPH_FRAMES, PAD_FRAMES, TorchSpeechTokenizer, probe_log_mel
from cosyvoice_opt.errors import CheckpointError, EngineBusy
from cosyvoice_opt.frontend.audio import PromptAudio, decode_audio, resample, trim_silence
from cosyvoice_opt.frontend.features import TOKENIZER_RATE, whisper_log_mel
from cosyvoice_opt.frontend.onnx_models import SpeechTokenizer
from cosyvoice_opt.limits import MAX_PROMPT_SECONDS
from cosyvoice_opt.models.speech_tokenizer import SpeechTokenizerV2, token_lengths
from cosyvoice_opt.random_model import write_random_campplus, write_s3_speech_tokenizer
from cosyvoice_opt.speech_tokenizer_weights import read_speech_tokenizer
from tests.tolerances import EXACT, SPEECH_TOKENIZER, assert_close

SMALL = {"layers": 2, "width": 256, "heads": 4, "hidden": 1024}  # every part of the released network, 4 heads
FSQ_VALUES = "/quantizer/Mul_output_0"  # the writer's node of the scaled tanh, before rounding


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("s3") / "speech_tokenizer_v2.onnx"
    write_s3_speech_tokenizer(path, seed=5, **SMALL)
    return path


def torch_tokenizer(path) -> SpeechTokenizerV2:
    cfg, state = read_speech_tokenizer(path)
    module = SpeechTokenizerV2(cfg)
    module.load_state_dict(state, strict=True)
    return module.eval()


def onnx_values(path, log_mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """onnxruntime's (ids, FSQ values) for one prompt: the values through an extra graph output."""
    model = onnx.load(path)
    model.graph.output.append(onnx.helper.make_tensor_value_info(FSQ_VALUES, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids, values = session.run(None, {"feats": log_mel.numpy(), "feats_length": np.array([log_mel.shape[-1]],
                                                                                           np.int32)})
    return torch.from_numpy(ids), torch.from_numpy(values)


def test_the_file_gives_the_network_its_shape(small_file):
    cfg, state = read_speech_tokenizer(small_file)
    assert (cfg.layers, cfg.width, cfg.heads, cfg.hidden, cfg.fsmn_taps) == (2, 256, 4, 1024, 31)
    assert (cfg.attn_ln_eps, cfg.mlp_ln_eps) == pytest.approx((1e-6, 1e-5))
    assert state["blocks.1.attn.key.weight"].shape == (256, 256) and "blocks.1.attn.key.bias" not in state


@pytest.mark.parametrize("frames", [1, 2, 57, 300, 301])
def test_the_pytorch_tokenizer_gives_onnxruntimes_values_and_ids(small_file, frames):
    log_mel = torch.randn(1, 128, frames, generator=torch.Generator().manual_seed(frames))
    ids, values = onnx_values(small_file, log_mel)
    module = torch_tokenizer(small_file)
    with torch.no_grad():
        ours = module.encode(log_mel, torch.tensor([frames]))
    assert ours.shape == values.shape == (1, int(token_lengths(torch.tensor(frames))), 8)
    assert_close(ours, values, SPEECH_TOKENIZER)
    # an id may differ only where a value lies within the tolerance of a rounding step (never seen here)
    settled = ((values.abs() - 0.5).abs() > 1e-4).all(-1)
    assert torch.equal(module.quantize(ours)[settled], ids.int()[settled])
    assert len(set(ids.flatten().tolist())) > min(3, ids.numel() - 1)  # the FSQ is not saturated: ids vary


def test_prompts_batched_together_get_the_tokens_they_get_alone(small_file):
    module = torch_tokenizer(small_file)
    gen = torch.Generator().manual_seed(1)
    mels = [torch.randn(1, 128, t, generator=gen) for t in (200, 57, 301)]
    padded = torch.zeros(3, 128, 301)
    for row, mel in zip(padded, mels, strict=True):
        row[:, : mel.shape[-1]] = mel[0]
    with torch.no_grad():
        batch = module.encode(padded, torch.tensor([m.shape[-1] for m in mels]))
        for row, mel in zip(batch, mels, strict=True):
            alone = module.encode(mel, torch.tensor([mel.shape[-1]]))[0]
            assert_close(row[: alone.shape[0]], alone, SPEECH_TOKENIZER)


def test_another_network_is_refused_with_what_did_not_fit(tmp_path):
    write_random_campplus(tmp_path / "campplus.onnx", seed=0)
    with pytest.raises(CheckpointError, match=r"campplus.onnx: not the S3Tokenizer v2 network \(found 1 input convs"):
        read_speech_tokenizer(tmp_path / "campplus.onnx")
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match="bad.onnx is not a valid ONNX model"):
        read_speech_tokenizer(tmp_path / "bad.onnx")


def test_the_port_is_used_only_when_it_agrees_with_onnxruntime(small_file, tmp_path):
    """The start-up check: weights that fit but compute other tokens (another file's, as a graph that differs would)
    are refused; the same file's pass, and give onnxruntime's ids for a prompt."""
    other = tmp_path / "other.onnx"
    write_s3_speech_tokenizer(other, seed=6, **SMALL)
    reference = SpeechTokenizer(small_file)
    with pytest.raises(CheckpointError, match=r"other.onnx: the PyTorch port's tokens agree with onnxruntime's on"):
        TorchSpeechTokenizer.load(other, torch.device("cpu"), reference)
    tokenizer = TorchSpeechTokenizer.load(small_file, torch.device("cpu"), reference)
    t = np.arange(3 * TOKENIZER_RATE) / TOKENIZER_RATE
    log_mel = whisper_log_mel(torch.from_numpy(0.3 * np.sin(2 * np.pi * 180 * t * (1 + t / 6))).float()[None])
    assert torch.equal(tokenizer(log_mel), reference(log_mel))
    assert tokenizer(probe_log_mel()).shape == reference(probe_log_mel()).shape


def run_together(tokenizer: TorchSpeechTokenizer, mels: list[torch.Tensor]) -> dict[int, torch.Tensor | Exception]:
    """Each mel from its own thread, all queued while a batch runs (the test holds the run lock), then released."""
    queued, results = threading.Event(), {}

    class Pending(list):
        def append(self, job):
            super().append(job)
            if len(self) == len(mels):
                queued.set()

    def call(i: int) -> None:
        try:
            results[i] = tokenizer(mels[i])
        except Exception as e:  # noqa: BLE001 - the test reads each caller's outcome
            results[i] = e

    with tokenizer._run_lock:
        tokenizer._pending = Pending()
        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(mels))]
        for th in threads:
            th.start()
        assert queued.wait(30)
    for th in threads:
        th.join(30)
    return results


def test_weights_that_do_not_fit_the_network_are_refused(small_file, monkeypatch):
    """A file whose blocks lack a weight (or hold one of another shape) is refused with a reason, not a traceback."""
    cfg, state = read_speech_tokenizer(small_file)
    del state["blocks.1.mlp.2.bias"]
    monkeypatch.setattr(torch_speech_tokenizer, "read_speech_tokenizer", lambda path: (cfg, state))
    with pytest.raises(CheckpointError, match=r"speech_tokenizer_v2.onnx: its weights do not fit the S3Tokenizer v2 "
                                              r"network \(Error\(s\) in loading state_dict"):
        TorchSpeechTokenizer.load(small_file, torch.device("cpu"), SpeechTokenizer(small_file))


def test_concurrent_prompts_run_in_one_batch(small_file, monkeypatch):
    """Callers arriving while a batch runs wait for it, then the first of them runs all of theirs at once."""
    tokenizer = TorchSpeechTokenizer(torch_tokenizer(small_file), torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    mels = [torch.randn(1, 128, t, generator=gen) for t in (120, 33, 250)]
    alone = [tokenizer(m) for m in mels]
    assert tokenizer.batches == 3
    results = run_together(tokenizer, mels)
    assert tokenizer.batches == 4  # all three in one
    for i, ids in enumerate(alone):
        assert_close(results[i], ids, EXACT)
    monkeypatch.setattr(torch_speech_tokenizer, "MAX_BATCH", 2)
    results = run_together(tokenizer, mels)
    assert tokenizer.batches == 6  # two, then one: each caller runs batches until its own prompt is done
    for i, ids in enumerate(alone):
        assert_close(results[i], ids, EXACT)


def test_prompts_are_padded_to_a_few_shapes(small_file):
    """A new length is a new conv input shape, and cuDNN builds a plan per shape: lengths share padded shapes."""
    tokenizer = TorchSpeechTokenizer(torch_tokenizer(small_file), torch.device("cpu"))
    shapes, forward = [], tokenizer.module.forward
    tokenizer.module.forward = lambda mel, frames: (shapes.append(tuple(mel.shape)), forward(mel, frames))[1]
    for frames in (1, 120, PAD_FRAMES, PAD_FRAMES + 1):
        assert tokenizer(torch.randn(1, 128, frames)).shape == (1, int(token_lengths(torch.tensor(frames))))
    assert shapes == [(1, 128, PAD_FRAMES)] * 3 + [(1, 128, 2 * PAD_FRAMES)]


class _Replayed:
    """A captured graph's stand-in on the CPU: a replay runs the forward over its static inputs into its output."""

    def __init__(self, lone) -> None:
        self.lone, self.replays = lone, 0

    def replay(self) -> None:
        self.replays += 1
        self.lone.ids.copy_(self.lone.module(self.lone.mel, self.lone.frames))


def test_a_lone_prompt_replays_the_graph_of_its_padded_length_and_prompts_together_run_eagerly(small_file):
    """A prompt that comes alone runs through the graph of its padded length (its ids those of the forward over its
    padded mel); prompts that come together run as one eager batch; the lengths captured cover the longest prompt."""
    tokenizer = TorchSpeechTokenizer(torch_tokenizer(small_file), torch.device("cpu"))
    tokenizer.graphs.capturing = True  # as on CUDA, with these stand-ins for its captures
    graphs = {}
    for frames in (PAD_FRAMES, 2 * PAD_FRAMES):
        lone = tokenizer._lone(frames)
        lone.ids = lone.module(lone.mel, lone.frames)
        lone.graph = graphs[frames] = _Replayed(lone)
        tokenizer.graphs.entries[frames] = lone
    gen = torch.Generator().manual_seed(3)
    for frames, padded in ((PAD_FRAMES + 1, 2 * PAD_FRAMES), (57, PAD_FRAMES), (2 * PAD_FRAMES, 2 * PAD_FRAMES)):
        mel = torch.randn(1, 128, frames, generator=gen)
        n = int(token_lengths(torch.tensor(frames)))
        expected = tokenizer.module(torch.nn.functional.pad(mel, (0, padded - frames)), torch.tensor([frames]))
        assert_close(tokenizer(mel), expected[:, :n], EXACT)
    assert [graphs[PAD_FRAMES].replays, graphs[2 * PAD_FRAMES].replays] == [1, 2]
    assert tokenizer.replays == 3 and tokenizer.graphs.misses == 0 and tokenizer.batches == 3
    mels = [torch.randn(1, 128, t, generator=gen) for t in (120, 33)]
    alone = [tokenizer(m) for m in mels]
    results = run_together(tokenizer, mels)
    assert tokenizer.batches == 6 and tokenizer.replays == 5  # the two together: one batch, no graph
    for i, ids in enumerate(alone):
        assert_close(results[i], ids, EXACT)
    longest = decode_audio((TOKENIZER_RATE, np.zeros(int(MAX_PROMPT_SECONDS * TOKENIZER_RATE), np.float32)))[0]
    assert whisper_log_mel(torch.from_numpy(longest)).shape[-1] <= GRAPH_FRAMES[-1]


def test_a_failing_batch_fails_each_of_its_callers(small_file):
    tokenizer = TorchSpeechTokenizer(torch_tokenizer(small_file), torch.device("cpu"))
    results = run_together(tokenizer, [torch.randn(1, 128, 40), torch.randn(1, 80, 100)])  # 80 mels: refused
    assert all(isinstance(r, RuntimeError) for r in results.values()), results
    assert tokenizer(torch.randn(1, 128, 40)).shape == (1, 10)  # and the next call runs


def test_out_of_gpu_memory_is_a_busy_refusal(small_file, monkeypatch):
    """A full GPU refuses the new voices of the batch as busy (HTTP 503 with Retry-After), not as a failure."""
    tokenizer = TorchSpeechTokenizer(torch_tokenizer(small_file), torch.device("cpu"))
    forward = tokenizer.module.forward

    def full(mel, frames):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(tokenizer.module, "forward", full)
    results = run_together(tokenizer, [torch.randn(1, 128, 40), torch.randn(1, 128, 90)])
    assert all(isinstance(r, EngineBusy) and "retry" in str(r) for r in results.values()), results
    monkeypatch.setattr(tokenizer.module, "forward", forward)
    assert tokenizer(torch.randn(1, 128, 40)).shape == (1, 10)


def test_the_engine_makes_a_new_voices_tokens_in_pytorch_when_asked(tmp_path):
    """`speech_tokenizer="torch"` on the CPU (on a GPU "auto" chooses it): the tiny random model's tokenizer is the
    released network, checked at start; a new voice's tokens are onnxruntime's."""
    config = EngineConfig(random_size="tiny", device="cpu", speech_tokenizer="torch", warmup=False,
                          voices_dir=str(tmp_path))
    with Engine.from_model_dir(None, config) as engine:
        assert engine.info["speech_tokenizer"] == "CPU (PyTorch)"
        assert isinstance(engine.speech_tokenizer, TorchSpeechTokenizer)
        t = np.arange(int(2.5 * 22050)) / 22050
        wav = (0.3 * np.sin(2 * np.pi * 200 * t) * (1 + 0.5 * np.sin(2 * np.pi * 2 * t))).astype(np.float32)
        before = engine.speech_tokenizer.batches
        tokens = engine.prompt_features((22050, wav)).speech_tokens
        assert engine.speech_tokenizer.batches == before + 1
        reference = SpeechTokenizer(engine._parts.model.speech_tokenizer_path)
        audio, rate = decode_audio((22050, wav))
        mono = trim_silence(PromptAudio(torch.from_numpy(audio).mean(dim=0, keepdim=True), rate))
        expected = reference(whisper_log_mel(resample(mono.wav, mono.sample_rate, TOKENIZER_RATE)))
        assert torch.equal(tokens, expected[:, : tokens.shape[1]])
    with Engine.from_model_dir(None, EngineConfig(random_size="tiny", device="cpu", warmup=False,
                                                  voices_dir=str(tmp_path))) as engine:
        assert engine.info["speech_tokenizer"] == "CPU (onnxruntime)"  # "auto" off the GPU


def test_asking_for_pytorch_with_another_network_fails_at_start(tmp_path, monkeypatch):
    from cosyvoice_opt import random_model

    monkeypatch.setattr(random_model, "write_s3_speech_tokenizer",
                        lambda path, seed, **kw: write_random_campplus(path, seed))
    monkeypatch.setattr(random_model, "TINY_TOKENIZER_BYTES", 0)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = EngineConfig(random_size="tiny", device="cpu", speech_tokenizer="torch", warmup=False,
                          voices_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match="not the S3Tokenizer v2 network"):
        Engine.from_model_dir(None, config)


def test_auto_keeps_onnxruntime_when_the_port_cannot_run(tmp_path, monkeypatch, caplog):
    """On a GPU, "auto" falls back to onnxruntime, with the reason in the log, when the file does not fit or the GPU
    has no room for the network; "torch" fails instead."""
    from cosyvoice_opt.engine import engine as engine_module

    config = EngineConfig(random_size="tiny", device="cpu", warmup=False, voices_dir=str(tmp_path))
    with Engine.from_model_dir(None, config) as engine:
        onnx_tokenizer, model = engine.speech_tokenizer, engine._parts.model
        engine.device = torch.device("cuda")  # what "auto" looks at; the load below never reaches the device
        for error in (CheckpointError("speech_tokenizer_v2.onnx: not the S3Tokenizer v2 network (found 1 input "
                                      "convs of kernel 3 and no projection to the 8 FSQ dims)"),
                      torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")):
            def refuse(*args, error=error):
                raise error

            monkeypatch.setattr(engine_module.TorchSpeechTokenizer, "load", refuse)
            with caplog.at_level("WARNING"):
                engine._speech_tokenizer_in_torch(model, "auto")
            assert engine.speech_tokenizer is onnx_tokenizer
            assert f"the speech tokenizer runs in onnxruntime on the host: {str(error).split('.')[0]}" in caplog.text
            with pytest.raises(type(error)):
                engine._speech_tokenizer_in_torch(model, "torch")


def test_the_choice_is_checked():
    with pytest.raises(Exception, match="speech_tokenizer must be one of auto, torch, onnx, got 'gpu'"):
        EngineConfig(speech_tokenizer="gpu")


@pytest.mark.gpu
def test_on_a_gpu_a_new_voices_tokens_are_made_there(tmp_path):
    """"auto" on CUDA: the port on the GPU, on its own stream, agreeing with onnxruntime; a new voice alone replays
    the graph of its padded length, captured at start-up, and gets the eager forward's tokens."""
    with Engine.from_model_dir(None, EngineConfig(random_size="tiny", voices_dir=str(tmp_path))) as engine:
        tokenizer = engine.speech_tokenizer
        assert engine.info["speech_tokenizer"] == "GPU (PyTorch)"
        assert isinstance(tokenizer, TorchSpeechTokenizer) and tokenizer.stream is not None
        assert next(tokenizer.module.parameters()).is_cuda
        before, replays = tokenizer.batches, tokenizer.replays
        assert tokenizer.graphs.captures == len(GRAPH_FRAMES) == len(tokenizer.graphs.entries)
        t = np.arange(3 * 16000) / 16000
        wav = (0.3 * np.sin(2 * np.pi * 150 * t * (1 + t / 5))).astype(np.float32)
        tokens = engine.prompt_features((16000, wav)).speech_tokens
        assert tokenizer.batches == before + 1 and tokenizer.replays == replays + 1  # alone: its length's graph
        assert tokenizer.graphs.misses == 0
        mel = whisper_log_mel(trim_silence(PromptAudio(torch.from_numpy(wav)[None], 16000)).wav)
        eager = tokenizer.module(torch.nn.functional.pad(mel, (0, -mel.shape[-1] % PAD_FRAMES)).cuda(),
                                 torch.tensor([mel.shape[-1]]).cuda()).cpu()
        assert torch.equal(tokens, eager[:, : tokens.shape[1]])
        reference = SpeechTokenizer(engine._parts.model.speech_tokenizer_path)
        expected = reference(whisper_log_mel(torch.from_numpy(wav)[None]))[:, : tokens.shape[1]]
        assert (tokens == expected).float().mean() >= 0.95
