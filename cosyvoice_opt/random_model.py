"""Seeded random-weight models: the three networks in memory, plus the frontend files they need on disk.

The app starts on a random model when there is no model folder, and the tests run on the tiny one. Next to the
weights, a random model needs what the frontend reads from files: a small real Qwen2-format tokenizer and two ONNX
networks with the released input/output names: the speech tokenizer's released network (small for a tiny model) and
a CAM++ stand-in (of the released size for a full model). The
writers live here, away from the runtime modules that load such files, and `onnx` (the writer's library) is imported
only when an ONNX file is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .checkpoint import SPEECH_TOKENIZER_FILES, TOKENIZER_DIR, LoadedModel, build_modules
from .config import Family, ModelConfig
from .frontend.special_tokens import ENDOFTEXT, QWEN2_SPECIAL_TOKENS, added_special_tokens
from .yaml_config import render_yaml

RELEASED_ENDOFTEXT = 151643  # `<|endoftext|>` in the released Qwen2 vocabulary
FSQ_DIMS = 8  # the speech tokenizer's FSQ: 8 dims of 3 levels = 6561 codes
EMBEDDING_DIM = 192  # CAM++ speaker embedding
# attention blocks of the released speech tokenizers (v2: 6; v3: 12, as its public PyTorch port has them)
FULL_TOKENIZER_LAYERS = {Family.COSYVOICE2: 6, Family.COSYVOICE3: 12}
FULL_TOKENIZER_BYTES = 100_000_000  # a speech tokenizer file smaller than this is a small stand-in
FULL_CAMPPLUS_BYTES = 10_000_000  # and a speaker encoder file smaller than this
TINY_TOKENIZER = {"layers": 1, "width": 64, "heads": 1, "hidden": 128}  # the released network, made small
TINY_TOKENIZER_BYTES = 200_000  # a tokenizer file smaller than this is an older cache's stand-in of another network

_QWEN2_PRETOKENIZE = (  # Qwen2's pre-tokenizer split pattern
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello world, this is a test of the speech synthesis system.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "How are you doing today? I am fine, thank you. What would you like to talk about?",
    "Streaming text to speech turns written words into natural sounding audio in real time.",
    "Please speak a little more slowly, with a happy voice, like a friendly teacher reading a story.",
    "One, two, three, four, five, six, seven, eight, nine, ten. Numbers and dates are read out loud.",
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。",
    "今天天气很好，我们一起去公园散步吧。春天来了，花开了，小鸟在树上唱歌。",
    "希望你以后能够做的比我还好呦。这是一个语音合成系统的测试，请用四川话说这句话。",
    "夏天的时候，我们一起去海边游泳，晒太阳，吃西瓜，真是太开心了！秋天，树叶黄了。",
    "我们的声音克隆只需要三秒钟的提示音频，就可以用同样的声音说出任何文字。",
)


# ---- weights ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def randomize_(module: nn.Module, seed: int) -> nn.Module:
    """Seeded random weights in the spirit of the parity fixtures: norms near 1, matrices scaled by 1/sqrt(fan_in)."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    seen = set()
    for name, p in module.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        if p.dim() >= 2:
            p.copy_(noise / max(1, p[0].numel()) ** 0.5)
        elif "norm" in name or name.endswith("original0") or name.endswith("alpha"):
            p.copy_(1 + 0.1 * noise)
        else:
            p.copy_(0.1 * noise)
    return module


def random_model(size: str, seed: int = 0, device: str | torch.device = "cpu",
                 frontend_dir: Path | None = None, family: Family | str = Family.COSYVOICE2) -> LoadedModel:
    """A seeded random-weight model of `family` of the released shapes ('full') or a small one ('tiny'), in memory.

    The frontend files (tokenizer folder, two ONNX networks: `write_frontend_files`) are written to `frontend_dir`
    (default: a per-user cache folder), since the tokenizer and onnxruntime read files.
    """
    family = Family(family)
    config = _config_for_size(size, family)
    llm, flow, hift = build_modules(config, device)
    for i, m in enumerate((llm, flow, hift)):
        randomize_(m, seed * 3 + i)
    if frontend_dir is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cosyvoice-opt"
        named = "" if family == Family.COSYVOICE2 else f"{family.value}-"
        frontend_dir = cache / f"random-{named}{size}-frontend-{seed}"
    write_frontend_files(frontend_dir, config, seed, full=size == "full")
    named = "" if family == Family.COSYVOICE2 else f"{family.value} "
    return LoadedModel(config, llm.eval(), flow.eval(), hift.eval(), frontend_dir, is_random=True,
                       description=f"random {named}{size} (seed {seed})")


def _config_for_size(size: str, family: Family) -> ModelConfig:
    if size not in ("full", "tiny"):
        raise ValueError(f"random model size must be 'full' or 'tiny', not {size!r}")
    return ModelConfig.full(family) if size == "full" else ModelConfig.tiny(family)


def write_frontend_files(folder: Path, config: ModelConfig, seed: int, full: bool = False) -> None:
    """Tokenizer folder, yaml and random ONNX models of the config's family: everything but the three state dicts.
    The speech tokenizer is the released network (`write_s3_speech_tokenizer`), at its size with `full`, else
    small. With `full` the speaker encoder has the released one's size (`write_full_campplus`), else it is a small
    stand-in. Smaller files found in the folder (an older cache's) are replaced. A CosyVoice3 tokenizer puts
    `<|endoftext|>` at the released id, where its LLM finds `<|endofprompt|>`."""
    family = config.family
    tok = folder / TOKENIZER_DIR
    if not (tok / "config.json").is_file():
        tok.mkdir(parents=True, exist_ok=True)
        endoftext = RELEASED_ENDOFTEXT if family == Family.COSYVOICE3 else None
        write_random_tokenizer_folder(tok, config.llm.qwen2.vocab_size, family=family, endoftext_id=endoftext)
        (tok / "config.json").write_text(json.dumps(config.llm.qwen2.to_hf(), indent=2))
    tokenizer = {"layers": FULL_TOKENIZER_LAYERS[family]} if full else TINY_TOKENIZER
    networks = (  # (file, the least size of the wanted one, its writer)
        (folder / SPEECH_TOKENIZER_FILES[family], FULL_TOKENIZER_BYTES if full else TINY_TOKENIZER_BYTES,
         lambda path: write_s3_speech_tokenizer(path, seed, **tokenizer)),
        (folder / "campplus.onnx", FULL_CAMPPLUS_BYTES if full else 0,
         lambda path: (write_full_campplus if full else write_random_campplus)(path, seed)),
    )
    for path, least_bytes, write in networks:
        if not path.is_file() or path.stat().st_size < least_bytes:
            write(path)
    (folder / f"{family.value}.yaml").write_text(render_yaml(config))


def write_random_model_folder(folder: str | os.PathLike, size: str, seed: int = 0,
                              family: Family | str = Family.COSYVOICE2) -> Path:
    """A complete model folder of `family` in the released layout with seeded random weights."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = random_model(size, seed, frontend_dir=folder, family=family)
    for name, module in model.parts().items():
        torch.save(module.state_dict(), folder / f"{name}.pt")
    return folder


# ---- text tokenizer --------------------------------------------------------------------------------------------
def write_random_tokenizer_folder(path: str | Path, vocab_size: int, num_merges: int = 400,
                                  family: Family = Family.COSYVOICE2, endoftext_id: int | None = None) -> Path:
    """Write a small real Qwen2-format tokenizer (vocab.json, merges.txt, tokenizer_config.json) for random models.

    A byte-level BPE is trained offline on built-in English and Chinese text; the three Qwen2 specials follow the
    BPE vocab and the family's added specials (17 or 278) follow them when loaded, so every id stays below
    `vocab_size`. With `endoftext_id`, unused filler entries (never produced: no merge makes them) pad the vocab so
    that the specials start at that id, as in the released tokenizer.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    n_specials = len(QWEN2_SPECIAL_TOKENS) + len(added_special_tokens(family))
    num_merges = min(num_merges, vocab_size - 256 - n_specials)
    if num_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} is too small: a byte-level tokenizer needs {256 + n_specials} ids")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=256 + num_merges, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_TRAINING_TEXT, trainer)
    tok.decoder = decoders.ByteLevel()

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(path))  # vocab.json + merges.txt
    first = tok.get_vocab_size()
    if endoftext_id is not None:
        if not first <= endoftext_id <= vocab_size - n_specials:
            raise ValueError(f"<|endoftext|> at {endoftext_id} does not fit a vocab of {vocab_size} after {first} "
                             "BPE entries")
        vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
        vocab.update({f"<|filler_{i}|>": i for i in range(first, endoftext_id)})
        (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        first = endoftext_id
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "added_tokens_decoder": {str(first + i): {"content": t, **flags} for i, t in enumerate(QWEN2_SPECIAL_TOKENS)},
        "bos_token": None,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return path


# ---- ONNX stand-ins --------------------------------------------------------------------------------------------
def _conv(name: str, x: str, rng: np.random.Generator, c_in: int, c_out: int, stride: int) -> tuple:
    """Conv1d(kernel 3, padding 1) with N(0, 1/fan_in) weights: (node, initializers)."""
    from onnx import helper, numpy_helper

    w = (rng.standard_normal((c_out, c_in, 3)) / np.sqrt(3 * c_in)).astype(np.float32)
    b = (0.1 * rng.standard_normal(c_out)).astype(np.float32)
    inits = [numpy_helper.from_array(w, f"{name}.weight"), numpy_helper.from_array(b, f"{name}.bias")]
    node = helper.make_node("Conv", [x, f"{name}.weight", f"{name}.bias"], [name], kernel_shape=[3],
                            pads=[1, 1], strides=[stride])
    return node, inits


def _save(nodes: list, inputs: list, outputs: list, inits: list, path: str | os.PathLike, name: str) -> None:
    import onnx
    from onnx import helper

    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
                              producer_name="cosyvoice_opt")
    onnx.checker.check_model(model)
    # written beside, then renamed: a process that starts meanwhile (two engines on one GPU share the cache folder)
    # finds the whole file or none, never a part of a full model's 0.5 GB
    partial = f"{os.fspath(path)}.{os.getpid()}.partial"
    onnx.save(model, partial)
    os.replace(partial, path)


def write_s3_speech_tokenizer(path: str | os.PathLike, seed: int = 0, layers: int = 6, width: int = 1280,
                              heads: int = 20, hidden: int = 5120) -> None:
    """A random tokenizer of the released network (`models.speech_tokenizer`): at the default sizes a new voice
    costs the benchmark what it costs a user (124M parameters), and at any size the PyTorch port has an onnxruntime
    reference. The released I/O (`feats [1,128,T]`, `feats_length [1]` int32 -> `indices [1,n]` int32,
    `n = ((T+1)//2+1)//2`) and nodes named as in the released file
    (`/blocks.0/attn/query/MatMul`, ...), which is how `speech_tokenizer_weights` finds the weights. Rotary tables
    for 1024 tokens (41 s; prompts are at most 30 s)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    taps, head_dim, max_rows = 31, width // heads, 1024
    nodes, inits = [], []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def normal(shape: tuple[int, ...], scale: float) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def node(op: str, inputs: list[str], name: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [f"{name}_output_0"], name=name, **attrs))
        return f"{name}_output_0"

    def linear(scope: str, x: str, c_in: int, c_out: int, bias: bool = True, gain: float = 1.0) -> str:
        y = node("MatMul", [x, const(f"onnx::MatMul_{scope}", normal((c_in, c_out), gain * c_in ** -0.5))],
                 f"{scope}/MatMul")
        return node("Add", [const(f"{scope[1:]}.bias", normal((c_out,), 0.1)), y], f"{scope}/Add") if bias else y

    def gelu(scope: str, x: str) -> str:  # 0.5 x (1 + erf(x / sqrt 2))
        erf = node("Erf", [node("Div", [x, "sqrt2"], f"{scope}/Div")], f"{scope}/Erf")
        return node("Mul", [node("Mul", [x, node("Add", [erf, "one"], f"{scope}/Add")], f"{scope}/Mul"), "half"],
                    f"{scope}/Mul_1")

    def layer_norm(scope: str, x: str, eps: float) -> str:
        return node("LayerNormalization", [x, const(f"{scope[1:]}.weight", 1 + normal((width,), 0.1)),
                                           const(f"{scope[1:]}.bias", normal((width,), 0.1))],
                    f"{scope}/LayerNormalization", axis=-1, epsilon=eps)

    def rotary(scope: str, x: str) -> str:  # x [1, T, heads, head_dim]
        left = node("Slice", [x, "zero", "half_dim", "axis3"], f"{scope}/Slice")
        right = node("Slice", [x, "half_dim", "head_dim", "axis3"], f"{scope}/Slice_1")
        turned = node("Concat", [node("Neg", [right], f"{scope}/Neg"), left], f"{scope}/Concat", axis=-1)
        return node("Add", [node("Mul", [x, "cos"], f"{scope}/Mul"), node("Mul", [turned, "sin"], f"{scope}/Mul_1")],
                    f"{scope}/Add")

    const("sqrt2", np.float32(np.sqrt(2)))
    const("one", np.float32(1.0))
    const("half", np.float32(0.5))
    const("scale", np.float32(head_dim ** -0.25))
    const("fsq_scale", np.float32(0.999))
    const("zero", np.array([0], np.int64))
    const("axis0", np.array([0], np.int64))
    const("axis3", np.array([3], np.int64))
    const("half_dim", np.array([head_dim // 2], np.int64))
    const("head_dim", np.array([head_dim], np.int64))
    const("heads_shape", np.array([1, -1, heads, head_dim], np.int64))
    const("rows_shape", np.array([1, -1, width], np.int64))
    freqs = 1.0 / 10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    angles = np.tile(np.outer(np.arange(max_rows, dtype=np.float32), freqs), (1, 2))[:, None, :]
    const("rope.cos", np.cos(angles).astype(np.float32))
    const("rope.sin", np.sin(angles).astype(np.float32))
    x = "feats"
    for i, c_in in enumerate((128, width), start=1):
        w = const(f"onnx::Conv_conv{i}.weight", normal((width, c_in, 3), (3 * c_in) ** -0.5))
        b = const(f"onnx::Conv_conv{i}.bias", normal((width,), 0.1))
        x = gelu(f"/conv{i}/gelu", node("Conv", [x, w, b], f"/conv{i}/Conv", kernel_shape=[3], pads=[1, 1],
                                         strides=[2]))
    x = node("Transpose", [x], "/Transpose", perm=[0, 2, 1])  # [1, n, width]
    n = node("Unsqueeze", [node("Gather", [node("Shape", [x], "/Shape"), const("one_i", np.int64(1))], "/Gather"),
                           "axis0"], "/Unsqueeze")
    node("Slice", ["rope.cos", "zero", n, "axis0"], "/rope/cos")
    node("Slice", ["rope.sin", "zero", n, "axis0"], "/rope/sin")
    nodes.extend([helper.make_node("Identity", ["/rope/cos_output_0"], ["cos"], name="/rope/cos_id"),
                  helper.make_node("Identity", ["/rope/sin_output_0"], ["sin"], name="/rope/sin_id")])
    for i in range(layers):
        b = f"/blocks.{i}"
        h = layer_norm(f"{b}/attn_ln", x, 1e-6)
        v_rows = linear(f"{b}/attn/value", h, width, width)
        q, k, v = (node("Reshape", [rows, "heads_shape"], f"{b}/attn/Reshape_{j}") for j, rows in
                   enumerate((linear(f"{b}/attn/query", h, width, width),
                              linear(f"{b}/attn/key", h, width, width, bias=False), v_rows)))
        q = node("Mul", [node("Transpose", [rotary(f"{b}/attn/rope_q", q)], f"{b}/attn/Transpose", perm=[0, 2, 1, 3]),
                         "scale"], f"{b}/attn/Mul")
        k = node("Mul", [node("Transpose", [rotary(f"{b}/attn/rope_k", k)], f"{b}/attn/Transpose_1",
                              perm=[0, 2, 3, 1]), "scale"], f"{b}/attn/Mul_1")
        p = node("Softmax", [node("MatMul", [q, k], f"{b}/attn/MatMul")], f"{b}/attn/Softmax", axis=-1)
        ctx = node("MatMul", [p, node("Transpose", [v], f"{b}/attn/Transpose_2", perm=[0, 2, 1, 3])],
                   f"{b}/attn/MatMul_1")
        ctx = node("Reshape", [node("Transpose", [ctx], f"{b}/attn/Transpose_3", perm=[0, 2, 1, 3]), "rows_shape"],
                   f"{b}/attn/Reshape_3")
        fsmn_w = const(f"onnx::Conv_{b}.fsmn", normal((width, 1, taps), taps ** -0.5))
        memory = node("Conv", [node("Transpose", [v_rows], f"{b}/attn/Transpose_4", perm=[0, 2, 1]), fsmn_w],
                      f"{b}/attn/fsmn_block/Conv", kernel_shape=[taps], group=width, pads=[taps // 2, taps // 2])
        memory = node("Add", [node("Transpose", [memory], f"{b}/attn/Transpose_5", perm=[0, 2, 1]), v_rows],
                      f"{b}/attn/Add")
        attn = node("Add", [linear(f"{b}/attn/out", ctx, width, width), memory], f"{b}/attn/Add_1")
        x = node("Add", [x, attn], f"{b}/Add")
        h = gelu(f"{b}/mlp/mlp.1", linear(f"{b}/mlp/mlp.0", layer_norm(f"{b}/mlp_ln", x, 1e-5), width, hidden))
        x = node("Add", [x, linear(f"{b}/mlp/mlp.2", h, hidden, width)], f"{b}/Add_1")
    # small enough that the FSQ's values spread over its rounding steps instead of saturating
    digits = linear("/quantizer/project_down", x, width, FSQ_DIMS, gain=0.3)  # [1, n, 8]
    scaled = node("Mul", [node("Tanh", [digits], "/quantizer/Tanh"), "fsq_scale"], "/quantizer/Mul")
    level = node("Add", [node("Round", [scaled], "/quantizer/Round"), "one"], "/quantizer/Add")  # {0, 1, 2}
    powers = const("fsq.powers", (3.0 ** np.arange(FSQ_DIMS)).astype(np.float32).reshape(FSQ_DIMS, 1))
    code = node("Squeeze", [node("MatMul", [level, powers], "/quantizer/MatMul"), const("axis2", np.array([2]))],
                "/quantizer/Squeeze")
    nodes.append(helper.make_node("Cast", [code], ["indices"], name="/quantizer/Cast", to=TensorProto.INT32))
    inputs = [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
              helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])]
    outputs = [helper.make_tensor_value_info("indices", TensorProto.INT32, [1, "n"])]
    _save(nodes, inputs, outputs, inits, path, "full_speech_tokenizer")


def write_full_campplus(path: str | os.PathLike, seed: int = 0) -> None:
    """A random speaker encoder of about the released CAM++'s size (7M parameters, 5 GFLOP for a 6 s prompt), for what
    a new voice costs: the released I/O as `write_random_campplus`; a 2-D conv front over the fbank (32 channels, the
    frequencies halved), then 1-D convs of 512 channels at half the frame rate, mean over time and a linear map. Its
    layers are not CAM++'s (densely connected TDNN blocks with context-aware masks): only its size is."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def conv(name: str, x: str, shape: tuple[int, ...], strides: list[int], pads: list[int]) -> str:
        fan_in = int(np.prod(shape[1:]))
        w = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in / 2))
        inits.extend([numpy_helper.from_array(w, f"{name}.weight"),
                      numpy_helper.from_array(np.zeros(shape[0], np.float32), f"{name}.bias")])
        nodes.extend([helper.make_node("Conv", [x, f"{name}.weight", f"{name}.bias"], [f"{name}.out"],
                                       kernel_shape=list(shape[2:]), strides=strides, pads=pads),
                      helper.make_node("Relu", [f"{name}.out"], [name])])
        return name

    inits += [numpy_helper.from_array(np.array([1], np.int64), "axis1"),
              numpy_helper.from_array(np.array([1, 32 * 40, -1], np.int64), "rows_shape")]
    nodes += [helper.make_node("Transpose", ["input"], ["x_ft"], perm=[0, 2, 1]),  # [1, 80, T]
              helper.make_node("Unsqueeze", ["x_ft", "axis1"], ["x2d"])]  # [1, 1, 80, T]
    x = conv("front.0", "x2d", (32, 1, 3, 3), [1, 1], [1, 1, 1, 1])
    x = conv("front.1", x, (32, 32, 3, 3), [2, 1], [1, 1, 1, 1])  # 40 frequencies
    for i in (2, 3):
        x = conv(f"front.{i}", x, (32, 32, 3, 3), [1, 1], [1, 1, 1, 1])
    nodes.append(helper.make_node("Reshape", [x, "rows_shape"], ["x1d"]))  # [1, 1280, T]
    x = conv("tdnn.0", "x1d", (512, 32 * 40, 5), [2], [2, 2])
    for i in range(1, 5):
        x = conv(f"tdnn.{i}", x, (512, 512, 3), [1], [1, 1])
    w = rng.standard_normal((512, EMBEDDING_DIM), dtype=np.float32) / np.float32(np.sqrt(512))
    inits += [numpy_helper.from_array(w, "proj.weight"),
              numpy_helper.from_array(np.zeros(EMBEDDING_DIM, np.float32), "proj.bias")]
    nodes += [helper.make_node("GlobalAveragePool", [x], ["pooled"]),  # [1, 512, 1]
              helper.make_node("Flatten", ["pooled"], ["flat"]),
              helper.make_node("Gemm", ["flat", "proj.weight", "proj.bias"], ["embedding"])]
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])]
    outputs = [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, EMBEDDING_DIM])]
    _save(nodes, inputs, outputs, inits, path, "full_campplus")


def write_random_campplus(path: str | os.PathLike, seed: int = 0, channels: int = 32) -> None:
    """A tiny CAM++ stand-in with the released I/O: `input [1,T,80]` -> `embedding [1,192]` (conv, ReLU, mean over
    time, linear)."""
    from onnx import TensorProto, helper, numpy_helper

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
