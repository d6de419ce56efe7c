"""The two ONNX models of the prompt path (speech tokenizer, CAM++ speaker encoder), run with onnxruntime.

Random stand-ins with the released input/output names come from `random_model`."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import torch

from cosyvoice_opt.errors import CheckpointError

# A new voice's two networks run side by side (`features.start_prompt_features`), each on several cores. On the
# H200's 16-core host, for a 6 s prompt (docs/benchmarks.md, run AB): the speech tokenizer (124M parameters) 431 ms
# on 1 thread, 128 on 4, 68 on 8, 47 on 16; CAM++ 61, 19, 12 and 20 ms. The tokenizer takes half the cores (at most
# 16), CAM++ a quarter (at most 8; it ends first), and the engine's own threads keep the rest.
TOKENIZER_THREADS = min(16, max(1, (os.cpu_count() or 1) // 2))
SPEAKER_THREADS = min(8, max(1, (os.cpu_count() or 1) // 4))


def _providers() -> list[str]:
    available = ort.get_available_providers()
    if torch.cuda.is_available() and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class _OnnxModel:
    """An onnxruntime model fed by its input names in position order (the names are not relied on)."""

    what = "ONNX model"

    @staticmethod
    def threads() -> int:
        """onnxruntime's intra-op threads for this network, read when it loads."""
        return 1

    def __init__(self, path: str | os.PathLike, providers: list[str] | None = None):
        name = os.path.basename(path)
        if not os.path.isfile(path):
            raise CheckpointError(f"{self.what} file {name} is missing from the model folder.")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = self.threads()
        try:
            self.runtime = ort.InferenceSession(os.fspath(path), opts, providers=providers or _providers())
        except Exception as e:  # onnxruntime raises its own untyped errors for corrupt files
            raise CheckpointError(f"{self.what} file {name} is not a valid ONNX model: {type(e).__name__}.") from e
        self.input_names = [i.name for i in self.runtime.get_inputs()]
        gpu = "CUDAExecutionProvider" in self.runtime.get_providers()
        self.runs_on = f"{'GPU' if gpu else 'CPU'} (onnxruntime)"

    def _run(self, *inputs: np.ndarray) -> np.ndarray:
        return self.runtime.run(None, dict(zip(self.input_names, inputs, strict=True)))[0]


class SpeechTokenizer(_OnnxModel):
    """`speech_tokenizer_v2.onnx` (CosyVoice2) or `_v3.onnx` (CosyVoice3): whisper log-mel `[1, 128, T]` -> 25 Hz
    speech token ids `[1, n]` int32 (n as the network gives it)."""

    what = "Speech tokenizer"

    @staticmethod
    def threads() -> int:
        return TOKENIZER_THREADS

    def __call__(self, log_mel: torch.Tensor) -> torch.Tensor:
        feats = log_mel.detach().to("cpu", torch.float32).numpy()
        ids = self._run(feats, np.array([feats.shape[2]], dtype=np.int32))
        return torch.from_numpy(ids.reshape(1, -1).astype(np.int32))


class SpeakerEncoder(_OnnxModel):
    """`campplus.onnx`: mean-normalised kaldi fbank `[1, T, 80]` -> speaker embedding `[1, 192]` float32."""

    what = "Speaker encoder"

    @staticmethod
    def threads() -> int:
        return SPEAKER_THREADS

    def __call__(self, fbank: torch.Tensor) -> torch.Tensor:
        emb = self._run(fbank.detach().to("cpu", torch.float32).numpy())
        return torch.from_numpy(emb.reshape(1, -1).astype(np.float32))
