"""Read `speech_tokenizer_v2.onnx`'s weights into `models.speech_tokenizer.SpeechTokenizerV2`.

The released file is a PyTorch export: its block weights feed nodes named by their module path
(`/blocks.3/attn/query/MatMul`, `/blocks.3/mlp_ln/LayerNormalization`, ...), the two input convs and the FSQ's
projection are told apart by their shapes. Nothing is executed: `onnx.load` reads protobuf, not pickles. A file that
is not this network (another tokenizer, a small stand-in) raises `CheckpointError` with what did not fit, and runs in
onnxruntime instead; one whose weights fit but whose graph computes something else is caught by the engine's check
against onnxruntime at start-up.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

import numpy as np
import torch

from .errors import CheckpointError
from .models.speech_tokenizer import SpeechTokenizerConfig

_BLOCK = re.compile(r"^/blocks\.(\d+)/(attn/(?:query|key|value|out)|mlp/mlp\.[02])/(MatMul|Add)(?:_\d+)?$")
_FSMN = re.compile(r"^/blocks\.(\d+)/attn/fsmn_block/Conv$")
_NORM = re.compile(r"^/blocks\.(\d+)/(attn_ln|mlp_ln)/LayerNormalization$")


def read_speech_tokenizer(path: str | os.PathLike) -> tuple[SpeechTokenizerConfig, dict[str, torch.Tensor]]:
    """(its config, a state dict for `SpeechTokenizerV2`) from the ONNX file at `path`."""
    import onnx
    from onnx import numpy_helper

    name = os.path.basename(path)
    try:
        graph = onnx.load(os.fspath(path)).graph
    except Exception as e:  # protobuf's decode errors are untyped
        raise CheckpointError(f"{name} is not a valid ONNX model: {type(e).__name__}") from e
    weights = {i.name: i for i in graph.initializer}

    def weight(node, index: int = 1) -> np.ndarray | None:
        found = [weights[x] for x in node.input if x in weights]
        return numpy_helper.to_array(found[index - 1]) if len(found) >= index else None

    sd: dict[str, np.ndarray] = {}
    eps: dict[str, float] = {}
    convs, down = [], None
    for node in graph.node:
        if m := _BLOCK.match(node.name):
            w = weight(node)
            if w is not None:
                sd[f"blocks.{m[1]}.{m[2].replace('/', '.').replace('mlp.mlp', 'mlp')}."
                   f"{'weight' if m[3] == 'MatMul' else 'bias'}"] = w.T if m[3] == "MatMul" else w
        elif m := _FSMN.match(node.name):
            sd[f"blocks.{m[1]}.attn.fsmn_block.weight"] = weight(node)
        elif m := _NORM.match(node.name):
            sd[f"blocks.{m[1]}.{m[2]}.weight"], sd[f"blocks.{m[1]}.{m[2]}.bias"] = weight(node), weight(node, 2)
            eps[m[2]] = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        elif node.op_type == "Conv" and (w := weight(node)) is not None and w.ndim == 3 and w.shape[2] == 3:
            convs.append((w, weight(node, 2)))
        elif node.op_type == "MatMul" and (w := weight(node)) is not None and w.ndim == 2 and w.shape[1] == 8:
            down = node
    if len(convs) != 2 or down is None:
        raise CheckpointError(f"{name}: not the S3Tokenizer v2 network (found {len(convs)} input convs of kernel 3 "
                              f"and {'a' if down else 'no'} projection to the 8 FSQ dims)")
    (sd["conv1.weight"], sd["conv1.bias"]), (sd["conv2.weight"], sd["conv2.bias"]) = convs
    sd["project_down.weight"] = weight(down).T
    bias = [n for n in graph.node if n.op_type == "Add" and down.output[0] in n.input]
    sd["project_down.bias"] = weight(bias[0]) if bias else None
    missing = sorted(k for k, v in sd.items() if v is None)
    if missing:
        raise CheckpointError(f"{name}: not the S3Tokenizer v2 network ({missing[0]} has no weight)")
    layers = 1 + max((int(k.split(".")[1]) for k in sd if k.startswith("blocks.")), default=-1)
    width, n_mels = sd["conv1.weight"].shape[:2]
    hidden = sd["blocks.0.mlp.0.weight"].shape[0] if layers else 4 * width
    heads = _heads(graph, weights, width)
    cfg = SpeechTokenizerConfig(n_mels=n_mels, width=width, heads=heads, layers=layers, hidden=hidden,
                                fsmn_taps=sd["blocks.0.attn.fsmn_block.weight"].shape[-1] if layers else 31,
                                fsq_dims=sd["project_down.weight"].shape[0],
                                attn_ln_eps=eps.get("attn_ln", 1e-6), mlp_ln_eps=eps.get("mlp_ln", 1e-5))
    return cfg, {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in sd.items()}


def _heads(graph, weights: dict, width: int) -> int:
    """The head count, from the first block's head-splitting Reshape (`[1, -1, heads, head_dim]`) where its shape is
    a constant, else heads of 64 dims (the released 1280 / 20, and the rotary width of the s3tokenizer port)."""
    from onnx import numpy_helper

    shapes = defaultdict(int)
    for node in graph.node:
        if node.op_type == "Reshape" and node.name.startswith("/blocks.0/attn/") and node.input[1] in weights:
            shape = numpy_helper.to_array(weights[node.input[1]]).tolist()
            if len(shape) == 4 and shape[2] * shape[3] == width:
                shapes[shape[2]] += 1
    return max(shapes, key=shapes.get) if shapes else width // 64
