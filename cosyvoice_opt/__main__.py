"""Command line: `cosyvoice-opt {serve,cluster,synth,bench,check-model,random-model}` (or `python -m cosyvoice_opt`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .config import COSYVOICE2, FAMILIES
from .errors import CosyVoiceError


def _check_model(args: argparse.Namespace) -> int:
    import torch

    from . import checkpoint
    from .frontend.tokenizer import TextTokenizer
    from .random_model import random_model

    t0 = time.perf_counter()
    try:
        if args.random:
            model = random_model(args.random, args.seed, family=args.family)
        else:
            model_dir = checkpoint.find_model_dir(args.model_dir)
            if model_dir is None:
                raise CosyVoiceError(f"no model folder found; {checkpoint.WHERE_TO_GET}, or use --random tiny|full")
            model = checkpoint.load_model(model_dir)
            _check_onnx(model)
        tokenizer = TextTokenizer.from_folder(model.tokenizer_dir)  # what `serve` and `synth` load next
    except CosyVoiceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"model: {model.description}")
    print(f"family: {checkpoint.FAMILY_NAMES[model.family]}")
    print(f"{'part':<6} {'params':>9} {'dtype':<8} {'on disk':>9}  verdict")
    for name, module in model.parts().items():
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()})
        path = model.model_dir / f"{name}.pt"
        size = f"{path.stat().st_size / 2**20:.1f} MiB" if path.is_file() and not model.is_random else "in memory"
        params = checkpoint.parameter_count(module) / 1e6
        print(f"{name:<6} {params:>8.1f}M {','.join(dtypes):<8} {size:>9}  ok")
    print(f"tokenizer: {tokenizer.num_ids} ids ({model.tokenizer_dir.name}/)  ok")
    print(f"speech tokenizer: {_speech_tokenizer_verdict(model.speech_tokenizer_path)}")
    print(f"verdict: loadable ({time.perf_counter() - t0:.1f} s, torch {torch.__version__})")
    return 0


def _speech_tokenizer_verdict(path: Path) -> str:
    """Where `serve` runs the speech tokenizer: the released network in PyTorch on a GPU (its tokens are checked
    against onnxruntime's when the engine starts), anything else in onnxruntime on the host."""
    from .errors import CheckpointError
    from .speech_tokenizer_weights import read_speech_tokenizer

    try:
        cfg, _ = read_speech_tokenizer(path)
    except CheckpointError as e:
        return f"runs in onnxruntime on the host ({e})"
    return (f"the released network ({cfg.layers} blocks of {cfg.width}): runs in PyTorch on a GPU, checked against "
            "onnxruntime when the engine starts")


def _check_onnx(model) -> None:
    import onnxruntime as ort

    from .errors import CheckpointError, first_sentence

    for path in (model.campplus_path, model.speech_tokenizer_path):
        try:
            ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types
            first = first_sentence(e)
            raise CheckpointError(f"{path.name}: not a valid ONNX model ({first})") from None


def _random_model(args: argparse.Namespace) -> int:
    from .random_model import write_random_model_folder

    folder = write_random_model_folder(args.dir, args.size, args.seed, args.family)
    print(f"wrote a random {args.family} {args.size} model (seed {args.seed}) to {folder}")
    return 0


def program_name() -> str:
    """How this process was started, for usage lines: `cosyvoice-opt` (the console script) or `python -m
    cosyvoice_opt`."""
    return "cosyvoice-opt" if Path(sys.argv[0]).stem == "cosyvoice-opt" else "python -m cosyvoice_opt"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=program_name(), description="Serve, synthesise with, benchmark and check "
                                     "CosyVoice2 and CosyVoice3 models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check-model", help="validate a model folder (or a random model) and print its parts")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model-dir", help="default: $COSYVOICE_MODEL_DIR, then pretrained_models/CosyVoice2-0.5B")
    which.add_argument("--random", choices=["tiny", "full"], help="check a seeded random-weight model instead")
    p.add_argument("--family", choices=FAMILIES, default=COSYVOICE2, help="family of the --random model")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_check_model)

    p = sub.add_parser("random-model", help="write a model folder with seeded random weights")
    p.add_argument("dir")
    p.add_argument("--size", choices=["tiny", "full"], default="tiny")
    p.add_argument("--family", choices=FAMILIES, default=COSYVOICE2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_random_model)

    bench = sub.add_parser("bench", help="the benchmark (see README)", add_help=False)
    bench.set_defaults(func=None)
    synth = sub.add_parser("synth", help="synthesise a wav from the command line", add_help=False)
    synth.set_defaults(func=None)
    serve = sub.add_parser("serve", help="launch the WebUI (same flags as app.py)", add_help=False)
    serve.set_defaults(func=None)

    cluster = sub.add_parser("cluster", help="serve the WebUI and the HTTP API from N engine replicas on Ray Serve",
                             add_help=False)
    cluster.set_defaults(func=None)

    args, rest = parser.parse_known_args(argv)
    if args.command == "cluster":
        from .cluster import main as cluster_main

        return cluster_main(rest, prog=cluster.prog)
    if args.command == "bench":
        from .bench.cli import main as bench_main

        return bench_main(rest, prog=bench.prog)
    if args.command == "synth":
        from .synth import main as synth_main

        return synth_main(rest, prog=synth.prog)
    if args.command == "serve":
        from .webui import main as webui_main

        webui_main(rest, prog=serve.prog)
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
