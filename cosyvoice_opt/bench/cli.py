"""`python -m cosyvoice_opt bench`: one command line for the three benchmarks, and the dispatch to them.

- the sweep (default, `closed_loop.py`): closed rounds of equal requests per precision x concurrency x streaming;
- `--soak SECONDS` (`soak.py`): N clients loop over the HTTP API; memory over time, failures;
- `--serve` (`serving.py`): traffic as users send it (Poisson arrivals or closed-loop clients, a new voice,
  text and length per request), in-process or over HTTP; per-load latency, underruns, throughput; `--capacity`.

The three share the engine flags. This module is the only one that imports all three, so they never import each
other.
"""

from __future__ import annotations

import argparse
import logging

from cosyvoice_opt.config import COSYVOICE2, FAMILIES, SPEECH_TOKENIZER_CHOICES

SWEEP_PRECISION = "fp32,bf16"
SERVE_PRECISION = "auto"
SWEEP_WARMUP_ROUNDS = 1
SERVE_WARMUP_S = 5.0


def parse_args(argv: list[str] | None, prog: str = "python -m cosyvoice_opt bench") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", help="a CosyVoice2-0.5B folder (default: random weights)")
    p.add_argument("--random", choices=("tiny", "full"), default=None, help="random-weight model size (default full)")
    p.add_argument("--family", choices=FAMILIES, default=COSYVOICE2, help="family of the --random model")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    p.add_argument("--precision", default=None,
                   help=f"comma list of fp32|fp16|bf16|auto (sweep default {SWEEP_PRECISION}; soak: the first; "
                        f"serve default {SERVE_PRECISION})")
    p.add_argument("--stream", default="1,0", help="comma list of 1 (streaming) / 0 (one chunk)")
    p.add_argument("--concurrency", default=None,
                   help="comma list of concurrent requests (default 1,4,16,64,128; soak: clients, default 4)")
    p.add_argument("--tokens", type=int, default=250, help="speech tokens forced per request (EOS ignored)")
    p.add_argument("--warmup", type=float, default=None,
                   help=f"sweep: unmeasured rounds before each configuration (default {SWEEP_WARMUP_ROUNDS}); "
                        f"serve: unmeasured seconds of the same load before each window (default {SERVE_WARMUP_S:g})")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--speech-tokenizer", choices=SPEECH_TOKENIZER_CHOICES, default="auto",
                   help="where a new voice's speech tokens are made (see the server's flag)")
    p.add_argument("--compile", action="store_true", help="torch.compile the LLM decode step (see README)")
    p.add_argument("--json", help="write the results here")
    http = p.add_argument_group("HTTP (soak, and serve with --url or --http)")
    http.add_argument("--url", help="a running server (soak default: serve the API in this process on loopback)")
    http.add_argument("--api-key", help="bearer key for --url (default: COSYVOICE_API_KEY)")
    soak = p.add_argument_group("soak (load over the HTTP API instead of the sweep)")
    soak.add_argument("--soak", type=float, metavar="SECONDS", help="run N clients for this long")
    soak.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests")
    serve = p.add_argument_group("serve (traffic as users send it, instead of the sweep)")
    serve.add_argument("--serve", action="store_true", help="run the serving benchmark")
    serve.add_argument("--rates", default="1,3,6,12", help="open loop: comma list of Poisson arrival rates, req/s")
    serve.add_argument("--clients", default=None,
                       help="closed loop instead: comma list of client counts (each sends when its last ends)")
    serve.add_argument("--capacity", action="store_true",
                       help="search the highest rate that passes (doubling from the first of --rates, then bisecting)")
    serve.add_argument("--capacity-steps", type=int, default=8, help="open-loop runs the capacity search may make")
    serve.add_argument("--p95-ms", type=float, default=500.0,
                       help="capacity: first packet p95 limit, ms (besides no underrun, failure or refusal)")
    serve.add_argument("--duration", type=float, default=30.0, help="measured seconds per load")
    serve.add_argument("--prompt-seconds", default="3,10", help="prompt length range, s (uniform)")
    serve.add_argument("--audio-seconds", default="2,20",
                       help="output length range, s (uniform; forced as 25 tokens/s in-process, and over HTTP on "
                            "random weights)")
    serve.add_argument("--words-per-second", type=float, default=2.5,
                       help="words of text (and of prompt transcript) per second of audio")
    serve.add_argument("--seed", type=int, default=0, help="seed of the arrivals, voices, texts and lengths")
    serve.add_argument("--http", nargs="?", const="only", choices=("only", "both"), default=None,
                       help="over the HTTP API served in this process on loopback (clients in a child process); "
                            "'--http both': each load in-process, then over HTTP, on one engine, compared")
    serve.add_argument("--max-batch-size", type=int, default=64, help="the engine's LLM batch limit (serve)")
    serve.add_argument("--max-queue-wait", type=float, default=None,
                       help="the engine's queue bound, s: a request that cannot start within it is refused as busy "
                            "(serve; default the engine's)")
    serve.add_argument("--bistream", type=int, default=0, metavar="N",
                       help="N closed-loop clients beside each load whose text streams in (in-process only)")
    serve.add_argument("--text-rate", type=float, default=15.0, metavar="TOKENS_PER_S",
                       help="--bistream: text tokens per second each streamed text arrives at (an LLM's output)")
    args = p.parse_args(argv)
    if args.soak and args.serve:
        p.error("--soak and --serve are different benchmarks; choose one")
    if args.http and args.url:
        p.error("--http serves the API here; --url uses a running one; choose one")
    if args.http == "both" and args.capacity:
        p.error("--capacity searches one transport's capacity; use --http or no --http, not --http both")
    if args.bistream and (args.http or args.url or not args.serve):
        p.error("--bistream is a --serve load of this process's engine (not over --http or --url)")
    if args.bistream < 0 or not args.text_rate > 0:
        p.error("--bistream needs N >= 0 and --text-rate a positive rate")
    args.concurrency = args.concurrency or ("4" if args.soak else "1,4,16,64,128")
    args.precision = args.precision or (SERVE_PRECISION if args.serve else SWEEP_PRECISION)
    if args.warmup is None:
        args.warmup = SERVE_WARMUP_S if args.serve else SWEEP_WARMUP_ROUNDS
    if not args.serve:
        args.warmup = int(args.warmup)
    return args


def main(argv: list[str] | None = None, prog: str = "python -m cosyvoice_opt bench") -> int:
    args = parse_args(argv, prog)
    # engine progress (load, compile and graph captures, warm-up) and the soak's samples go to stderr as they happen
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.soak:
        from cosyvoice_opt.bench import soak

        return soak.main(args)
    if args.serve:
        from cosyvoice_opt.bench import serving

        return serving.main(args)
    from cosyvoice_opt.bench import closed_loop

    return closed_loop.run(args)
