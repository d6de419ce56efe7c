"""The speech tokenizer in PyTorch on the engine's GPU, instead of onnxruntime on the host.

A new voice waits for its speech tokens before anything else can start: on the host that is 68 ms of 8 cores for a
6 s prompt (docs/benchmarks.md, run AB), and it grows with the load. On the GPU the same network
(`models.speech_tokenizer`) takes a few milliseconds. It runs on its own CUDA stream, beside the decode loop's, and
prompts that arrive together go through in one padded batch. A prompt that comes alone (every new voice below full
load) replays a CUDA graph of its padded length, captured at start-up: its ~270 kernels launched one by one take the
host 6-8 ms, and twice that beside the engine's two threads (docs/benchmarks.md, run AP), against about 3-4 ms of GPU.

It is used only when the file's weights fit the network (`read_speech_tokenizer`) and, at start-up, its tokens for
a fixed probe agree with onnxruntime's on the same file. A file that fails either runs in onnxruntime on the host.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from cosyvoice_opt.engine.graph_capture import GraphSet, capture
from cosyvoice_opt.errors import CheckpointError, EngineBusy, first_sentence
from cosyvoice_opt.frontend.features import TOKENIZER_RATE, WHISPER_HOP, whisper_log_mel
from cosyvoice_opt.frontend.onnx_models import SpeechTokenizer
from cosyvoice_opt.limits import MAX_PROMPT_SECONDS
from cosyvoice_opt.models.speech_tokenizer import SpeechTokenizerV2, token_lengths
from cosyvoice_opt.speech_tokenizer_weights import read_speech_tokenizer

log = logging.getLogger(__name__)

PROBE_SECONDS = 4.0
# Tokens that must match onnxruntime's for the probe. The GPU's float32 sums run in another order (and cuDNN's convs
# in TF32), so a value lying on an FSQ rounding step may round the other way; a network that computes anything
# else disagrees on most tokens.
MIN_AGREEMENT = 0.95
# Prompts are padded to a multiple of this many frames (2 s): cuDNN builds a plan for each new conv input shape (tens
# of ms and about 1 MB of host memory each, `engine/backends.py`), and every new voice has a length of its own.
PAD_FRAMES = 200
# Prompts in one batch at most: the rest wait for the next (each waiting caller runs one in turn). Estimated, 16
# prompts of 30 s hold about 0.5 GB of activations (one 5120-wide MLP state of 750 tokens is 15 MB).
MAX_BATCH = 16
# A lone prompt replays the graph of its padded length: every length up to the longest prompt accepted.
_MAX_FRAMES = int(MAX_PROMPT_SECONDS * TOKENIZER_RATE) // WHISPER_HOP
GRAPH_FRAMES = tuple(range(PAD_FRAMES, -(-_MAX_FRAMES // PAD_FRAMES) * PAD_FRAMES + 1, PAD_FRAMES))


def probe_log_mel() -> Tensor:
    """A fixed, voice-like probe: a gliding 120-240 Hz tone with 20 harmonics and a little noise -> `[1, 128, T]`."""
    gen = torch.Generator().manual_seed(0)
    t = torch.arange(int(PROBE_SECONDS * TOKENIZER_RATE), dtype=torch.float64) / TOKENIZER_RATE
    phase = 2 * math.pi * (120 * t + 15 * t**2)
    wav = sum(torch.sin(k * phase) / k for k in range(1, 21)) * (0.5 + 0.5 * torch.sin(2 * math.pi * 3 * t))
    wav = 0.2 * wav + 0.01 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
    return whisper_log_mel(wav.float()[None])


class _LoneForward:
    """One prompt's forward at one padded length over static inputs: a CUDA graph once captured (`GraphSet`), else
    eager."""

    def __init__(self, module: SpeechTokenizerV2, frames: int, device: torch.device) -> None:
        self.module = module
        self.mel = torch.zeros(1, module.cfg.n_mels, frames, device=device)
        self.frames = torch.full((1,), frames, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.ids: Tensor | None = None

    def capture(self, pool: tuple[int, int] | None, stream: torch.cuda.Stream | None) -> None:
        """Warm up (cuDNN plans) and capture on `stream`."""
        with torch.inference_mode():
            stream.wait_stream(torch.cuda.current_stream(self.mel.device))
            with torch.cuda.stream(stream):
                self.module(self.mel, self.frames)
            graph = torch.cuda.CUDAGraph()
            with capture(graph, pool, stream):
                ids = self.module(self.mel, self.frames)
        self.graph, self.ids = graph, ids  # only once captured: a failed capture leaves this length eager

    def __call__(self, mel: Tensor, frames: Tensor) -> Tensor:
        """Ids `[1, n]` of `mel` `[1, n_mels, T]` (T this length) with `frames` valid, on the device."""
        self.mel.copy_(mel)
        self.frames.copy_(frames)
        if self.graph is None:
            return self.module(self.mel, self.frames)
        self.graph.replay()
        return self.ids


@dataclass
class _Job:
    log_mel: Tensor
    ids: Tensor | None = None
    error: BaseException | None = None


class TorchSpeechTokenizer:
    """`SpeechTokenizer`'s call in PyTorch on `device`: whisper log-mel `[1, 128, T]` -> ids `[1, n]` int32 on the
    host."""

    def __init__(self, module: SpeechTokenizerV2, device: torch.device):
        self.module = module.to(device).eval()
        self.device = device
        self.runs_on = f"{'GPU' if device.type == 'cuda' else device.type.upper()} (PyTorch)"
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.batches = 0  # padded batches run (each serves every prompt that was waiting)
        self.replays = 0  # of them, lone prompts that replayed a graph
        self.graphs: GraphSet[_LoneForward] = GraphSet("the tokenizer graph for %d frames", device,
                                                       capturing=device.type == "cuda")
        self._pending: list[_Job] = []
        self._pending_lock = threading.Lock()
        self._run_lock = threading.Lock()

    @classmethod
    def load(cls, path: str | os.PathLike, device: torch.device, reference: SpeechTokenizer) -> TorchSpeechTokenizer:
        """The network of the file at `path` on `device`, once its tokens for the probe agree with `reference`'s
        (onnxruntime on the same file); else `CheckpointError` saying why."""
        cfg, state = read_speech_tokenizer(path)
        module = SpeechTokenizerV2(cfg)
        try:
            module.load_state_dict(state, strict=True)
        except RuntimeError as e:  # a block without one of its weights, a weight of another shape
            raise CheckpointError(f"{os.path.basename(path)}: its weights do not fit the S3Tokenizer v2 network "
                                  f"({first_sentence(e)})") from None
        tokenizer = cls(module, device)
        probe = probe_log_mel()
        want, got = reference(probe), tokenizer(probe)
        agreement = (want == got).float().mean().item() if want.shape == got.shape else 0.0
        if agreement < MIN_AGREEMENT:
            raise CheckpointError(f"{os.path.basename(path)}: the PyTorch port's tokens agree with onnxruntime's on "
                                  f"{agreement:.0%} of a probe (at least {MIN_AGREEMENT:.0%} needed)")
        log.info("speech tokenizer on %s: %d blocks of %d, its tokens agree with onnxruntime's on %.1f%% of a probe",
                 device, cfg.layers, cfg.width, 100 * agreement)
        return tokenizer

    def capture_graphs(self, lengths: tuple[int, ...] = GRAPH_FRAMES) -> None:
        """Capture a lone prompt's forward at each padded length (CUDA only; before serving: it allocates)."""
        self.graphs.capture_all(list(lengths), self._lone)

    def _lone(self, frames: int) -> _LoneForward:
        return _LoneForward(self.module, frames, self.device)

    def __call__(self, log_mel: Tensor) -> Tensor:
        """Waits while another caller's batch runs, then runs the prompts waiting by then (at most `MAX_BATCH`, the
        longest-waiting first), its own included unless an earlier batch took it."""
        job = _Job(log_mel)
        with self._pending_lock:
            self._pending.append(job)
        with self._run_lock:
            while job.ids is None and job.error is None:
                with self._pending_lock:
                    batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
                self._run(batch)
        if job.error is not None:
            raise job.error
        return job.ids

    @torch.inference_mode()
    def _run(self, batch: list[_Job]) -> None:
        try:
            frames = torch.tensor([j.log_mel.shape[-1] for j in batch])
            longest = -(-int(frames.max()) // PAD_FRAMES) * PAD_FRAMES
            mel = torch.cat([F.pad(j.log_mel.float(), (0, longest - j.log_mel.shape[-1])) for j in batch])
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                if len(batch) == 1 and self.graphs.entries:  # captured (not yet for the start-up probe)
                    lone = self.graphs.get(longest, self._lone)
                    self.replays += lone.graph is not None
                    ids = lone(mel, frames).cpu()
                else:
                    ids = self.module(mel.to(self.device), frames.to(self.device)).cpu()
            self.batches += 1
            for job, row, n in zip(batch, ids, token_lengths(frames).tolist(), strict=True):
                job.ids = row[None, :n].clone()
        except Exception as e:  # every caller in the batch gets the failure, not only the one that ran it
            if isinstance(e, torch.cuda.OutOfMemoryError):  # the GPU is full: a refusal, as for any other overload
                e = EngineBusy("the GPU has no memory free for a new voice's speech tokens now; retry shortly")
            for job in batch:
                job.error = e
