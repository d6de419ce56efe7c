"""The vocoder for streaming chunks from CUDA graphs: one HiFT call is hundreds of small kernels, so eagerly it is
bound by their launch cost (measured on the H200: 16 ms per chunk at 1 row, 17 ms at 16), and a shape that cuDNN has
not seen costs its plans too (80-140 ms for a final chunk of a new length under load, against 1-6 ms replayed).

`VocoderGraphs` is the machinery both families' vocoders share: a fixed set of graphs by key (rows, *shape) captured
at start-up (`capture_all`, from the family's `hift_shapes`), each reading static inputs (views of buffers that all
shapes share) that a call writes eagerly right before the replay (`call`). The graphs share one memory pool: they run
one at a time on the vocoder thread and their outputs are copied out before the next replay. Without CUDA graphs
(CPU, tests) the same static-buffer code runs eagerly. A subclass says what a key's inputs are and what runs over
them; CosyVoice3's is `engine/causal_streaming.py`'s `CausalHiFTGraphs`.

`HiftGraphs` is CosyVoice2's. Its streaming chunks have a bounded set of shapes (`streaming.hift_shapes`: later hops'
chunks 108 or 208 frames after `source_cache_len` cached samples, at a power-of-two row count; a piece's first chunk,
a piece shorter than that, and a final chunk, one row at a time at each of their frame counts). Each graph replays
f0 -> source -> cache splice -> decode (`HiFT.inference` given its random inputs); the random inputs are drawn eagerly
beforehand from each row's own generator, exactly the draws of the eager `HiFT.inference(mel, cache, generators)`, so
both give the same audio.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

from cosyvoice_opt.engine.graph_capture import GraphSet, capture
from cosyvoice_opt.models.hift import HiFT, HiFTBase

log = logging.getLogger(__name__)

class _HiftGraph:
    """Static inputs of one shape and, on CUDA, the vocoder's work over them (`body`) captured."""

    def __init__(self, inputs: dict[str, Tensor], body: Callable[..., tuple[Tensor | None, ...]]) -> None:
        self.inputs = inputs
        self.body = body
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[Tensor | None, ...] | None = None

    def forward(self) -> tuple[Tensor | None, ...]:
        return self.body(**self.inputs)

    def capture(self, mempool, side: torch.cuda.Stream) -> None:
        """Warm up (cuDNN plans, the stream's cuBLAS workspace) and capture on `side`, this runner's own
        stream; thread-local, because the LLM thread keeps launching (and capturing) its own work meanwhile."""
        device = next(iter(self.inputs.values())).device
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, mempool, side):
            out = self.forward()
        self.graph, self.out = graph, out  # only once captured: a failed capture leaves this shape eager

    def run(self) -> tuple[Tensor | None, ...]:
        """The body's outputs for the inputs the caller wrote, as the caller's own tensors (replayed outputs are
        overwritten by the next replay; eager ones may be views of the static inputs)."""
        if self.graph is None:
            out = self.forward()
        else:
            self.graph.replay()
            out = self.out
        return tuple(None if t is None else t.clone() for t in out)


class VocoderGraphs:
    """A vocoder's calls through one graph per input shape, a key (rows, *shape); used only from the vocoder thread.
    A subclass says which static inputs a key has (`_inputs`) and what runs over them (`_body`), and writes a call's
    inputs (`call`).

    The static inputs of all keys are views of one buffer per input, shared by every shape (`_buffer`): HiFT's take
    ~17 KB per row and mel frame (mostly the noise: 230 MB for 64 rows of 208 frames).
    """

    label = "the vocoder graph for %s"  # a %-format of the key, for the log

    def __init__(self, hift: HiFTBase, cuda_graphs: bool) -> None:
        self.hift = hift
        self.device = hift.conv_pre.bias.device  # a tensor's: on CUDA always with its index
        self.graphs: GraphSet[_HiftGraph] = GraphSet(self.label, self.device,
                                                     cuda_graphs and self.device.type == "cuda")
        self._arenas: dict[str, Tensor] = {}
        self._rows: dict[Hashable, int] = {}  # shape -> most rows of a key of that shape in the set

    @torch.inference_mode()
    def capture_all(self, keys: list[tuple]) -> None:
        """Capture the graph of every (rows, *shape) key in `keys`, largest first (CUDA only; without CUDA graphs
        those shapes run from the same static buffers, eagerly)."""
        for rows, *shape in keys:
            self._rows[tuple(shape)] = max(rows, self._rows.get(tuple(shape), 0))
        self.graphs.capture_all(sorted(keys, reverse=True), self._make)

    def rows_per_call(self, *shape: Hashable) -> int | None:
        """How many rows one call of this input shape takes (a batch is padded to a power of two up to it), or None
        when the shape is not in the set (it runs eagerly)."""
        return self._rows.get(shape)

    def call(self, key: tuple, write: Callable[[dict[str, Tensor]], None]) -> tuple[Tensor | None, ...]:
        """Run key's graph (or, outside the set, the same body eagerly: a miss) after `write(inputs)` filled its
        static inputs; the outputs are the caller's."""
        graph = self.graphs.get(key, self._make)
        write(graph.inputs)
        return graph.run()

    def _make(self, key: tuple) -> _HiftGraph:
        return _HiftGraph(self._inputs(key), functools.partial(self._body, key))

    def _inputs(self, key: tuple) -> dict[str, Tensor]:
        """The static inputs of `key`, by the name `_body` takes them (views from `_buffer`)."""
        raise NotImplementedError

    def _body(self, key: tuple, **inputs: Tensor) -> tuple[Tensor | None, ...]:
        """The work a graph of `key` captures: fixed shapes, no host sync, no random draws."""
        raise NotImplementedError

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> Tensor:
        """A view of `shape` into the buffer of input `name` (in `dtype`, default the vocoder's). The shapes can share
        it because they run one at a time and read their inputs only while they run, right after `call` wrote them.
        A buffer too small is replaced by one at least twice its size; the shapes made before keep the old one
        alive."""
        size = math.prod(shape)
        arena = self._arenas.get(name)
        if arena is None or arena.numel() < size:
            grown = max(size, 2 * arena.numel()) if arena is not None else size
            arena = self._arenas[name] = torch.zeros(grown, device=self.device,
                                                     dtype=dtype or self.hift.conv_pre.bias.dtype)
        return arena[:size].view(shape)


class HiftGraphs(VocoderGraphs):
    """CosyVoice2's HiFT calls of streaming chunks, a key per (rows, mel frames, cached excitation samples): each
    graph replays f0 -> source -> cache splice -> decode (`HiFT.inference` given its random inputs)."""

    label = "the HiFT graph for %d rows x %d frames after %d cached samples"
    hift: HiFT

    def _inputs(self, key: tuple[int, int, int]) -> dict[str, Tensor]:
        rows, frames, cached = key
        dim, cfg = self.hift.m_source.dim, self.hift.cfg
        inputs = {"mel": self._buffer("mel", (rows, cfg.in_channels, frames)),
                  "phases": self._buffer("phases", (rows, dim)),
                  "noise": self._buffer("noise", (rows, frames * cfg.upsample_scale, dim))}  # contiguous, as eager's
        if cached:
            inputs["cache"] = self._buffer("cache", (rows, 1, cached))
        return inputs

    def _body(self, key: tuple[int, int, int], mel: Tensor, phases: Tensor, noise: Tensor,
              cache: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self.hift.inference(mel, cache, phases=phases, noise=noise)

    @torch.inference_mode()
    def inference(self, mel: Tensor, cache_source: Tensor | None,
                  generators: list[torch.Generator]) -> tuple[Tensor, Tensor]:
        """`HiFT.inference(mel [R,80,T], cache_source [R,1,S] or None, generators)` with one generator per row:
        the same draws from each, the same (speech [R,L], excitation [R,1,L]), as new tensors."""
        if len(generators) != mel.shape[0]:
            raise ValueError(f"one generator per row: {mel.shape[0]} rows, {len(generators)} generators")
        key = (mel.shape[0], mel.shape[2], 0 if cache_source is None else cache_source.shape[2])

        def write(inputs: dict[str, Tensor]) -> None:
            inputs["mel"].copy_(mel)
            if cache_source is not None:
                inputs["cache"].copy_(cache_source)
            kw = {"device": self.device, "dtype": inputs["noise"].dtype}
            drawn = [self.hift.m_source.draw(1, inputs["noise"].shape[1], g, **kw) for g in generators]
            torch.cat([phases for phases, _ in drawn], out=inputs["phases"])
            torch.cat([noise for _, noise in drawn], out=inputs["noise"])

        speech, source = self.call(key, write)
        return speech, source
