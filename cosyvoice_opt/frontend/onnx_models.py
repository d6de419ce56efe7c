"""The two ONNX models of the prompt path (speech tokenizer, CAM++ speaker encoder) and small random stand-ins with
the released input/output names, so the whole pipeline runs and is tested without the real files."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from cosyvoice_opt.errors import CheckpointError

SPEECH_VOCAB = 6561  # 3^8 FSQ codes
FSQ_DIMS = 8
EMBEDDING_DIM = 192


def _providers() -> list[str]:
    available = ort.get_available_providers()
    if torch.cuda.is_available() and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class _OnnxModel:
    """An inference session fed by the model's input names in position order (the names are not relied on)."""

    what = "ONNX model"

    def __init__(self, path: str | os.PathLike, providers: list[str] | None = None):
        name = os.path.basename(path)
        if not os.path.isfile(path):
            raise CheckpointError(f"{self.what} file {name} is missing from the model folder.")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(os.fspath(path), opts, providers=providers or _providers())
        except Exception as e:  # onnxruntime raises its own untyped errors for corrupt files
            raise CheckpointError(f"{self.what} file {name} is not a valid ONNX model: {type(e).__name__}.") from e
        self.input_names = [i.name for i in self.session.get_inputs()]

    def _run(self, *inputs: np.ndarray) -> np.ndarray:
        return self.session.run(None, dict(zip(self.input_names, inputs, strict=True)))[0]


class SpeechTokenizer(_OnnxModel):
    """`speech_tokenizer_v2.onnx`: whisper log-mel `[1, 128, T]` -> 25 Hz speech token ids `[1, n]` int32."""

    what = "Speech tokenizer"

    def __call__(self, log_mel: torch.Tensor) -> torch.Tensor:
        feats = log_mel.detach().to("cpu", torch.float32).numpy()
        ids = self._run(feats, np.array([feats.shape[2]], dtype=np.int32))
        return torch.from_numpy(ids.reshape(1, -1).astype(np.int32))


class SpeakerEncoder(_OnnxModel):
    """`campplus.onnx`: mean-normalised kaldi fbank `[1, T, 80]` -> speaker embedding `[1, 192]` float32."""

    what = "Speaker encoder"

    def __call__(self, fbank: torch.Tensor) -> torch.Tensor:
        emb = self._run(fbank.detach().to("cpu", torch.float32).numpy())
        return torch.from_numpy(emb.reshape(1, -1).astype(np.float32))


def _conv(name: str, x: str, rng: np.random.Generator, c_in: int, c_out: int, stride: int) -> tuple:
    """Conv1d(kernel 3, padding 1) with N(0, 1/fan_in) weights: (node, initializers)."""
    w = (rng.standard_normal((c_out, c_in, 3)) / np.sqrt(3 * c_in)).astype(np.float32)
    b = (0.1 * rng.standard_normal(c_out)).astype(np.float32)
    inits = [numpy_helper.from_array(w, f"{name}.weight"), numpy_helper.from_array(b, f"{name}.bias")]
    node = helper.make_node("Conv", [x, f"{name}.weight", f"{name}.bias"], [name], kernel_shape=[3],
                            pads=[1, 1], strides=[stride])
    return node, inits


def _save(nodes: list, inputs: list, outputs: list, inits: list, path: str | os.PathLike, name: str) -> None:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
                              producer_name="cosyvoice_opt")
    onnx.checker.check_model(model)
    onnx.save(model, os.fspath(path))


def write_random_speech_tokenizer(path: str | os.PathLike, seed: int = 0, channels: int = 16) -> None:
    """A tiny tokenizer with the released I/O: `feats [1,128,T]`, `feats_length [1]` int32 -> `indices [1,n]` int32,
    `n = ((T+1)//2+1)//2`. Two stride-2 convs, then an 8-dim 3-level FSQ like the real one: round(tanh) per dim,
    read as base-3 digits -> id in [0, 6561)."""
    rng = np.random.default_rng(seed)
    conv1, inits = _conv("conv1", "feats", rng, 128, channels, stride=2)
    conv2, inits2 = _conv("conv2", "relu1", rng, channels, FSQ_DIMS, stride=2)
    nodes = [conv1, helper.make_node("Relu", ["conv1"], ["relu1"]), conv2]
    inits += inits2
    digits_w = (3.0 ** np.arange(FSQ_DIMS)).astype(np.float32).reshape(1, FSQ_DIMS, 1)
    inits += [numpy_helper.from_array(digits_w, "fsq.powers"), numpy_helper.from_array(np.float32(1.0), "one"),
              numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1")]
    nodes += [
        helper.make_node("Tanh", ["conv2"], ["tanh"]),
        helper.make_node("Round", ["tanh"], ["level"]),  # {-1, 0, 1}
        helper.make_node("Add", ["level", "one"], ["digit"]),  # {0, 1, 2}
        helper.make_node("Conv", ["digit", "fsq.powers"], ["code"], kernel_shape=[1]),  # [1, 1, n]
        helper.make_node("Squeeze", ["code", "axis1"], ["code2d"]),
        helper.make_node("Cast", ["code2d"], ["indices"], to=TensorProto.INT32),
    ]
    inputs = [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
              helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])]
    outputs = [helper.make_tensor_value_info("indices", TensorProto.INT32, [1, "n"])]
    _save(nodes, inputs, outputs, inits, path, "random_speech_tokenizer")


def write_random_campplus(path: str | os.PathLike, seed: int = 0, channels: int = 32) -> None:
    """A tiny CAM++ stand-in with the released I/O: `input [1,T,80]` -> `embedding [1,192]` (conv, ReLU, mean over
    time, linear)."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Transpose", ["input"], ["x"], perm=[0, 2, 1])]
    conv, inits = _conv("conv", "x", rng, 80, channels, stride=1)
    w = (rng.standard_normal((channels, EMBEDDING_DIM)) / np.sqrt(channels)).astype(np.float32)
    b = (0.1 * rng.standard_normal(EMBEDDING_DIM)).astype(np.float32)
    inits += [numpy_helper.from_array(w, "proj.weight"), numpy_helper.from_array(b, "proj.bias")]
    nodes += [
        conv,
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pooled"]),  # [1, C, 1]
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Gemm", ["flat", "proj.weight", "proj.bias"], ["embedding"]),
    ]
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])]
    outputs = [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, EMBEDDING_DIM])]
    _save(nodes, inputs, outputs, inits, path, "random_campplus")
