"""What the engine asks of a model family (architecture.md, "Model families"): one object per loaded model, so that
the scheduler, admission, the KV cache, the graph ladders and the audio worker never ask which family they serve.

A family says:
* the stop rule: the ids that end decoding and the ids masked below min_len (`LLMConfig`, upstream's per family);
* the streaming schedule (`StreamConfig`: both families chunk 25 -> x2 -> 100 tokens with 3 look-ahead tokens) and
  which LLM tokens reach the flow (CosyVoice3 drops a silent-token run past its 5th token, `SilentRunFilter`);
* the flow runner: both families' chunks run from the paged flow pool through CUDA graphs captured at start-up
  (`FlowRunner`), and admission reserves their pages. The pool holds what the family's networks cache
  (`CacheLayout`, `EncoderLayout`): CosyVoice2's U-Net attention inputs and conformer K/V, CosyVoice3's DiT K/V
  after RoPE and its pre-lookahead conv;
* the vocoder and its CUDA graphs captured at start-up (`vocoder_graphs`, keys from `hift_shapes`): CosyVoice2's HiFT
  per chunk with its mel/excitation caches and cross-fade (`HiftStreamState`, batched by input shape, `HiftGraphs`);
  CosyVoice3's `CausalHiFT.stream`, which computes each chunk's new samples from a bounded left context and equals
  upstream's re-run over all mel so far, batched by step (`engine/causal_streaming.py`, `CausalHiFTGraphs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from cosyvoice_opt.config import Family, ModelConfig
from cosyvoice_opt.engine.causal_streaming import CausalHiFTGraphs, causal_hift_shapes, vocode_causal_chunks
from cosyvoice_opt.engine.flow_runner import FlowRunner
from cosyvoice_opt.engine.hift_graphs import HiftGraphs, VocoderGraphs
from cosyvoice_opt.engine.streaming import HiftStreamState, StreamConfig, hift_shapes, vocode_chunks
from cosyvoice_opt.models.causal_hift import CausalHiFT, CausalHiFTStream
from cosyvoice_opt.models.flow import FlowBase
from cosyvoice_opt.models.hift import HiFT, HiFTBase
from cosyvoice_opt.models.silent_tokens import SilentRunFilter

TokenFilter = Callable[[int], bool]
"""`keep(token) -> bool`, called once per LLM token in order: whether the flow receives it."""


class ModelFamily:
    """The parts of serving that differ per family (see the module docstring); `for_model` picks one."""

    family: Family
    name: str

    def __init__(self, config: ModelConfig, stream: StreamConfig | None = None) -> None:
        self.config = config
        self.stream = stream or StreamConfig()

    @staticmethod
    def for_model(config: ModelConfig, stream: StreamConfig | None = None) -> ModelFamily:
        return (CosyVoice3Family if config.family == Family.COSYVOICE3 else CosyVoice2Family)(config, stream)

    # ---- the stop rule -----------------------------------------------------------------------------------------
    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Sampled ids that end decoding without being emitted."""
        return self.config.llm.stop_token_ids

    @property
    def min_len_masked_ids(self) -> range:
        """Ids masked while fewer than min_len tokens were emitted."""
        return self.config.llm.min_len_masked_ids

    # ---- the flow ----------------------------------------------------------------------------------------------
    def token_filter(self) -> TokenFilter | None:
        """A fresh filter for one text piece's tokens, or None when the flow receives every token."""
        return None

    def flow_runner(self, flow: FlowBase, pages: Callable[[], tuple[int, int]], cuda_graphs: bool,
                    **kw: Any) -> FlowRunner:
        """The paged flow runner, its pool sized by `pages()` -> (pages, slots)."""
        return FlowRunner(flow, *pages(), cuda_graphs, **kw)

    # ---- the vocoder -------------------------------------------------------------------------------------------
    def vocoder_state(self, hift: HiFTBase) -> Any:
        """One text piece's vocoder state between its chunks."""
        raise NotImplementedError

    def vocoder_graphs(self, hift: HiFTBase, cuda_graphs: bool) -> VocoderGraphs:
        """The vocoder's graph set (captured from `hift_shapes` at start-up when `cuda_graphs`)."""
        raise NotImplementedError

    def hift_shapes(self, max_rows: int, hift: HiFTBase) -> list[tuple]:
        """The keys of `hift`'s vocoder graphs captured at start-up (batches of at most `max_rows` rows)."""
        raise NotImplementedError

    def vocode(self, hift: HiFTBase, states: list, mels: list[Tensor], finals: list[bool],
               generators: list[torch.Generator], graphs: VocoderGraphs | None, max_rows: int) -> list[Tensor]:
        """Each request's audio [1,L] for its chunk of new mel [1,80,T]. The states change only once every chunk
        ran, so a failed call (out of memory) can be retried from the same states."""
        raise NotImplementedError


class CosyVoice2Family(ModelFamily):
    family, name = Family.COSYVOICE2, "CosyVoice2"

    def vocoder_state(self, hift: HiFTBase) -> HiftStreamState:
        if not isinstance(hift, HiFT):
            raise TypeError(f"a CosyVoice2 model vocodes with HiFT, not {type(hift).__name__}")
        return HiftStreamState(self.stream)

    def vocoder_graphs(self, hift: HiFTBase, cuda_graphs: bool) -> HiftGraphs:
        return HiftGraphs(hift, cuda_graphs)

    def hift_shapes(self, max_rows: int, hift: HiFTBase) -> list[tuple[int, int, int]]:
        return hift_shapes(self.stream, max_rows)

    def vocode(self, hift: HiFTBase, states: list, mels: list[Tensor], finals: list[bool],
               generators: list[torch.Generator], graphs: VocoderGraphs | None, max_rows: int) -> list[Tensor]:
        return vocode_chunks(hift, states, mels, finals, generators, graphs, max_rows)


class CosyVoice3Family(ModelFamily):
    family, name = Family.COSYVOICE3, "CosyVoice3"

    def token_filter(self) -> TokenFilter:
        return SilentRunFilter().keep

    @staticmethod
    def _causal(hift: HiFTBase) -> CausalHiFT:
        if not isinstance(hift, CausalHiFT):
            raise TypeError(f"a CosyVoice3 model vocodes with CausalHiFT, not {type(hift).__name__}")
        return hift

    def vocoder_state(self, hift: HiFTBase) -> CausalHiFTStream:
        return self._causal(hift).new_stream()

    def vocoder_graphs(self, hift: HiFTBase, cuda_graphs: bool) -> CausalHiFTGraphs:
        return CausalHiFTGraphs(hift, cuda_graphs)

    def hift_shapes(self, max_rows: int, hift: HiFTBase) -> list[tuple]:
        return causal_hift_shapes(self._causal(hift), self.stream, max_rows)

    def vocode(self, hift: HiFTBase, states: list, mels: list[Tensor], finals: list[bool],
               generators: list[torch.Generator], graphs: VocoderGraphs | None, max_rows: int) -> list[Tensor]:
        # the fixed source noise needs no generator (a stream with Gaussian noise draws from its own)
        return vocode_causal_chunks(hift, states, mels, finals, graphs, max_rows)
