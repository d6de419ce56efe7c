"""CosyVoice3's flow, upstream `CausalMaskedDiffWithDiT`: speech tokens -> 80-d embedding -> pre-lookahead layer
-> each token repeated `token_mel_ratio` (2) times = `mu` at the mel rate; no encoder, so `mu` does not depend on
`streaming`. The CFM (`flow.CausalCFM`, the same solver as CosyVoice2's) runs the `DiT` estimator.

Everything else is `FlowBase`: upstream's call (`inference`) and incremental streaming (`new_stream` +
`stream_chunks`), where the pre-lookahead's causal conv and every DiT conv and attention keep their history in the
stream's carries, so each chunk runs only its own frames over K/V computed once.
"""

from __future__ import annotations

from torch import Tensor, nn

from cosyvoice_opt.config import FlowDiTConfig
from cosyvoice_opt.models.dit import DiT
from cosyvoice_opt.models.flow import CausalCFM, FlowBase
from cosyvoice_opt.models.flow_encoder import CarryBatch, PreLookahead


class FlowDiT(FlowBase):
    def __init__(self, cfg: FlowDiTConfig) -> None:
        super().__init__()
        if cfg.input_size != cfg.output_size:
            raise ValueError(f"the token embedding ({cfg.input_size}) must be as wide as the mel ({cfg.output_size})")
        self.cfg = cfg
        self.chunk_tokens = cfg.chunk_tokens
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookahead(cfg.input_size, cfg.pre_lookahead_len, cfg.pre_lookahead_channels)
        self.decoder = CausalCFM(cfg, DiT(cfg.estimator))

    def encode(self, ids: Tensor, real: Tensor | None, streaming: bool, carry: CarryBatch | None = None) -> Tensor:
        if carry is not None:
            carry.begin()
        x = self.input_embedding(ids.clamp(min=0))
        h = self.pre_lookahead_layer(x if real is None else x * real[..., None].to(x), carry)
        if carry is not None:
            carry.end()
        return h.repeat_interleave(self.cfg.token_mel_ratio, dim=1).transpose(1, 2)

    def stream_bytes_per_token(self, element_size: int) -> int:
        """Bytes a stream's state grows by per token: each Euler step's K and V of both CFG rows in every block for
        `token_mel_ratio` frames (the conv histories are of fixed size)."""
        est = self.cfg.estimator
        per_frame = len(self.decoder.steps) * 2 * est.depth * 2 * est.inner_dim
        return element_size * self.cfg.token_mel_ratio * per_frame
