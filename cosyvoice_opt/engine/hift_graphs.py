"""HiFT for streaming chunks from CUDA graphs: one HiFT call is hundreds of small kernels, so eagerly it is bound by
their launch cost (measured on the H200: 16 ms per chunk at 1 row, 17 ms at 16), and a shape that cuDNN has not seen
costs its plans too (80-140 ms for a final chunk of a new length under load, against 1-6 ms replayed).

Streaming chunks have a bounded set of shapes (`streaming.hift_shapes`: later hops' chunks 108 or 208 frames after
`source_cache_len` cached samples, at a power-of-two row count; a piece's first chunk, a piece shorter than that, and
a final chunk, one row at a time at each of their frame counts), and the graphs of all of them are captured at
start-up (`capture_all`). Each
graph reads static inputs (views of buffers that all shapes share) and replays f0 -> source -> cache splice -> decode
(`HiFT.inference` given its random inputs); the random inputs are drawn eagerly beforehand from each row's own
generator, exactly the draws of the eager `HiFT.inference(mel, cache, generators)`, so both give the same audio.
The graphs share one memory pool: they run one at a time on the vocoder thread and their outputs are copied out
before the next replay. Without CUDA graphs (CPU, tests) the same static-buffer code runs eagerly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import Tensor

from cosyvoice_opt.engine.graph_capture import GraphSet, capture
from cosyvoice_opt.models.hift import HiFT

log = logging.getLogger(__name__)

class _HiftGraph:
    """Static inputs of one (rows, mel frames, cached samples) shape and, on CUDA, HiFT captured over them."""

    def __init__(self, hift: HiFT, rows: int, frames: int, cached: int,
                 buffer: Callable[[str, tuple[int, ...]], Tensor]) -> None:
        self.hift = hift
        dim = hift.m_source.dim
        self.mel = buffer("mel", (rows, hift.cfg.in_channels, frames))
        self.cache = buffer("cache", (rows, 1, cached)) if cached else None
        self.phases = buffer("phases", (rows, dim))
        self.noise = buffer("noise", (rows, frames * hift.cfg.upsample_scale, dim))  # contiguous, as eager's cat
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[Tensor, Tensor] | None = None

    def forward(self) -> tuple[Tensor, Tensor]:
        return self.hift.inference(self.mel, self.cache, phases=self.phases, noise=self.noise)

    def capture(self, mempool, side: torch.cuda.Stream) -> None:
        """Warm up (cuDNN plans, the stream's cuBLAS workspace) and capture on `side`, this runner's own
        stream; thread-local, because the LLM thread keeps launching (and capturing) its own work meanwhile."""
        device = self.mel.device
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, mempool, side):
            out = self.forward()
        self.graph, self.out = graph, out  # only once captured: a failed capture leaves this shape eager

    def run(self, mel: Tensor, cache: Tensor | None, generators: list[torch.Generator]) -> tuple[Tensor, Tensor]:
        """`HiFT.inference(mel, cache, generators)`; the outputs are the caller's (copies when replayed)."""
        self.mel.copy_(mel)
        if self.cache is not None:
            self.cache.copy_(cache)
        kw = {"device": self.mel.device, "dtype": self.mel.dtype}
        drawn = [self.hift.m_source.draw(1, self.noise.shape[1], g, **kw) for g in generators]
        torch.cat([phases for phases, _ in drawn], out=self.phases)
        torch.cat([noise for _, noise in drawn], out=self.noise)
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        speech, source = self.out
        return speech.clone(), source.clone()


class HiftGraphs:
    """HiFT calls of streaming chunks through one graph per input shape; used only from the vocoder thread.

    Their static inputs take ~17 KB per row and mel frame (mostly the noise: 230 MB for 64 rows of 208 frames), so
    they are views of one buffer per input, shared by every shape (`_buffer`).
    """

    def __init__(self, hift: HiFT, cuda_graphs: bool) -> None:
        self.hift = hift
        self.device = hift.conv_pre.bias.device  # a tensor's: on CUDA always with its index
        self.graphs: GraphSet[_HiftGraph] = GraphSet(
            "the HiFT graph for %d rows x %d frames after %d cached samples", self.device,
            cuda_graphs and self.device.type == "cuda")
        self._arenas: dict[str, Tensor] = {}
        self._rows: dict[tuple[int, int], int] = {}  # (mel frames, cached samples) -> most rows of a shape in the set

    @torch.inference_mode()
    def capture_all(self, keys: list[tuple[int, int, int]]) -> None:
        """Capture the graph of every (rows, mel frames, cached samples) shape in `keys` (CUDA only; without CUDA
        graphs those shapes run from the same static buffers, eagerly)."""
        for rows, frames, cached in keys:
            self._rows[frames, cached] = max(rows, self._rows.get((frames, cached), 0))
        self.graphs.capture_all(sorted(keys, reverse=True), self._make)

    def rows_per_call(self, frames: int, cached: int) -> int | None:
        """How many rows one call of this input shape takes (a batch is padded to a power of two up to it), or None
        when the shape is not in the set (it runs eagerly)."""
        return self._rows.get((frames, cached))

    def _make(self, key: tuple[int, int, int]) -> _HiftGraph:
        return _HiftGraph(self.hift, *key, self._buffer)

    def _buffer(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """A view of `shape` into the buffer of input `name`. The shapes can share it because they run one at a time
        and read their inputs only while they run, right after `run` wrote them. A buffer too small is replaced by
        one at least twice its size; the shapes made before keep the old one alive."""
        size = math.prod(shape)
        arena = self._arenas.get(name)
        if arena is None or arena.numel() < size:
            grown = max(size, 2 * arena.numel()) if arena is not None else size
            arena = self._arenas[name] = self.hift.conv_pre.bias.new_zeros(grown)
        return arena[:size].view(shape)

    @torch.inference_mode()
    def inference(self, mel: Tensor, cache_source: Tensor | None,
                  generators: list[torch.Generator]) -> tuple[Tensor, Tensor]:
        """`HiFT.inference(mel [R,80,T], cache_source [R,1,S] or None, generators)` with one generator per row:
        the same draws from each, the same (speech [R,L], excitation [R,1,L]), as new tensors."""
        if len(generators) != mel.shape[0]:
            raise ValueError(f"one generator per row: {mel.shape[0]} rows, {len(generators)} generators")
        key = (mel.shape[0], mel.shape[2], 0 if cache_source is None else cache_source.shape[2])
        return self._graph(key).run(mel, cache_source, generators)

    def _graph(self, key: tuple[int, int, int]) -> _HiftGraph:
        return self.graphs.get(key, self._make)
