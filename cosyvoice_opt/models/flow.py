"""Flow matching (speech tokens -> mel): upstream's `CausalConditionalCFM` and what both families' flows share
(`FlowBase`), with CosyVoice2's `CausalMaskedDiffWithXvec` (`Flow`); CosyVoice3's is `flow_dit.FlowDiT`.

Two ways to run either:
* `Flow.inference(...)`: upstream's call (re-encodes prompt + all tokens; `streaming` picks block-causal
  attention, `finalize` whether the last 3 tokens are look-ahead).
* `Flow.new_stream(...)` + `Flow.stream_chunks(...)` (`stream_chunk` for one stream): incremental streaming.
  Encoder and estimator are block-causal (25-token / 50-frame chunks, every left chunk visible), the look-ahead is
  explicit and the CFM noise is fixed per frame, so a chunk that ends on a chunk boundary only needs its own frames
  plus the history the earlier chunks left in a `FlowStreamState`. The chunks concatenated equal one block-causal
  run over the whole sequence (`inference(streaming=True, finalize=True)`), seams included. The next chunks of
  several streams (any histories, any lengths) run as one padded batch whose rows equal the streams' own calls.

  Choice: upstream runs its *final* streaming call non-causally (`streaming=False` over everything) after causal
  chunks, so its last chunk differs slightly from a consistent causal run and the seam relies on HiFT's
  cross-fade. Ours stays causal to the end: every chunk is consistent with the previous ones, and only the last
  chunk differs from upstream's (by the causal-vs-full attention difference).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_opt.config import FlowConfig, FlowDiTConfig
from cosyvoice_opt.errors import InputError
from cosyvoice_opt.models.flow_encoder import Carry, CarryBatch, UpsampleConformerEncoder, to_device
from cosyvoice_opt.models.flow_estimator import CausalConditionalDecoder


class CausalCFM(nn.Module):
    """Conditional flow matching solved with Euler steps on a cosine time grid and classifier-free guidance.

    The estimator is CosyVoice2's U-Net (`CausalConditionalDecoder`) or CosyVoice3's `DiT`: any module called as
    `estimator(x, mask, mu, t, spks, cond, streaming, carry)`."""

    def __init__(self, cfg: FlowConfig | FlowDiTConfig, estimator: nn.Module) -> None:
        super().__init__()
        self.estimator = estimator
        self.cfg_rate = cfg.inference_cfg_rate
        self.n_mels, self.noise_frames = cfg.output_size, cfg.noise_frames
        # Upstream's grid in float32, with its accumulated t (t += dt; dt = t_span[k+1] - t).
        t_span = self.t_span(cfg.n_timesteps)
        t, self.steps = t_span[0], []
        for k in range(1, cfg.n_timesteps + 1):
            dt = t_span[k] - t
            self.steps.append((t.item(), dt.item()))
            t = t + dt
        self.register_buffer("rand_noise", torch.empty(0), persistent=False)
        self.init_noise()

    @staticmethod
    def t_span(n_timesteps: int) -> Tensor:
        """1 - cos(k/n · pi/2), k = 0..n (float32)."""
        return 1 - torch.cos(torch.linspace(0, 1, n_timesteps + 1, device="cpu") * 0.5 * math.pi)

    def init_noise(self) -> None:
        """(Re)draw the fixed noise `torch.manual_seed(0); randn(1, 80, frames)` on CPU with a private generator (the
        global RNG is untouched); a module built on the meta device must call this after materialising."""
        g = torch.Generator().manual_seed(0)
        noise = torch.randn(1, self.n_mels, self.noise_frames, generator=g, device="cpu")
        self.rand_noise = noise.to(device=self.rand_noise.device, dtype=self.rand_noise.dtype)

    def noise(self, start: int, n: int, like: Tensor) -> Tensor:
        """The noise of frames start..start+n-1 (each frame always gets the same noise)."""
        return self.rand_noise[:, :, start : start + n].to(like)

    @staticmethod
    def guided_inputs(mu: Tensor, spks: Tensor, cond: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Each item's conditioning as a conditional row and an unconditional (zeros) row, adjacent so that each
        stream's carry holds its 2 rows."""
        return tuple(torch.stack((a, torch.zeros_like(a)), dim=1).flatten(0, 1) for a in (mu, spks, cond))

    def velocity(
        self,
        x: Tensor,
        t: Tensor,
        inputs: tuple[Tensor, Tensor, Tensor],
        streaming: bool,
        mask: Tensor | None = None,
        carry: CarryBatch | None = None,
    ) -> Tensor:
        """The guided velocity at x [B,80,T], time t [2B], for `guided_inputs`; `mask` [2B,1,T] as the rows."""
        b = x.shape[0]
        mu_in, spks_in, cond_in = inputs
        v = self.estimator(x.repeat_interleave(2, dim=0), mask, mu_in, t, spks_in, cond_in, streaming, carry)
        v = v.view(b, 2, *v.shape[1:])
        return (1.0 + self.cfg_rate) * v[:, 0] - self.cfg_rate * v[:, 1]

    def solve(
        self,
        z: Tensor,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool,
        mask: Tensor | None = None,
        carries: list[CarryBatch] | None = None,
    ) -> Tensor:
        """Integrate from z [B,80,T] to t = 1 with guidance. `carries` (one per Euler step) make the frames follow
        the frames they have seen."""
        inputs = self.guided_inputs(mu, spks, cond)
        mask_in = None if mask is None else mask.repeat_interleave(2, dim=0)
        x = z
        for k, (t, dt) in enumerate(self.steps):
            # t stays float32 in any model dtype: the estimators take sin/cos of 1000·t, and bf16's t = 0.3 is off by
            # 0.0008, i.e. up to 0.8 rad
            t_in = torch.full((2 * z.shape[0],), t, device=z.device, dtype=torch.float32)
            x = x + dt * self.velocity(x, t_in, inputs, streaming, mask_in, None if carries is None else carries[k])
        return x


@dataclass
class FlowStreamState:
    """One request's incremental flow state (batch 1). Tensors are only ever replaced, never written in place.

    Per mel frame it grows by, in elements of the model dtype (CosyVoice2's `Flow` at full size in parentheses; each
    flow's `stream_bytes_per_token` says its own):
      estimator: n_timesteps x 2 CFG rows x (2 + num_mid_blocks) x n_blocks transformer blocks x channels
                 (10 x 2 x 56 x 256 = 286,720): the normalised attention inputs; K/V are recomputed from them
                 (K and V would take 2 x 512 per block: 4x more);
      encoder:   K and V of the 4 up-sampled layers (4 x 2 x 512 = 4,096) + half the 25 Hz layers' (3,072);
    = 293,888 elements (588 KB in bf16, 1.18 MB in fp32) per frame, 29 MB bf16 per second of audio (prompt
    included); plus fixed conv histories (a few frames per conv). `Flow.stream_bytes_per_token` computes it.
    """

    spks: Tensor  # [1,80]
    prompt_feat: Tensor  # [1,M,80]
    pending: Tensor  # prompt tokens not yet encoded (prepended to the first chunk)
    encoder: Carry = field(default_factory=Carry)
    steps: list[Carry] = field(default_factory=list)  # the estimator's, one per Euler step (unless paged elsewhere)
    frames: int = 0  # mel frames (prompt included) generated so far
    finished: bool = False

    @property
    def tokens(self) -> int:
        """Tokens (prompt included) encoded so far."""
        return self.encoder.pos

    @property
    def nbytes(self) -> int:
        return self.encoder.nbytes + sum(c.nbytes for c in self.steps)

    def snapshot(self) -> tuple:
        """Everything a chunk changes. Carries are never modified in place, so copying their slot lists is a full
        snapshot (cheap: no tensor is copied)."""
        carries = [(c, list(c.slots), c.pos) for c in [self.encoder, *self.steps]]
        return self.pending, self.finished, self.frames, carries

    def restore(self, snapshot: tuple) -> None:
        """Undo a failed chunk."""
        self.pending, self.finished, self.frames, carries = snapshot
        for carry, slots, pos in carries:
            carry.slots, carry.pos = slots, pos


EncodeFn = Callable[[list[FlowStreamState], Tensor, Tensor | None, list[int]], Tensor]
"""`encode(states, ids, real, lengths) -> mu`: `Flow.encode` of one chunk per stream, streaming, over a history kept
by the caller (`ids`, `real` as `Flow.encode` takes them; `lengths`: each row's new tokens). The states' encoder
positions advance afterwards; their carries stay empty."""


@dataclass
class ChunkBatch:
    """The CFM inputs of the next chunk of several streams (rows right-padded to the longest): what
    `Flow.prepare_chunks` makes and `Flow.finish_chunks` turns into each stream's mel."""

    states: list[FlowStreamState]  # the streams that have new frames (rows of the tensors)
    live: list[int]  # their indices in the call's list of streams
    count: int  # streams in the call
    f0: list[int]  # frames each row had before this chunk
    frames: list[int]  # new frames per row
    z: Tensor  # [B,80,N] the fixed noise of those frames
    mu: Tensor  # [B,80,N]
    cond: Tensor  # [B,80,N]
    spks: Tensor  # [B,80]


class FlowBase(nn.Module):
    """Speech tokens + prompt (tokens, mel, speaker embedding) -> mel [B,80,T] at 50 Hz: what both families share
    (the CFM inputs, upstream's call, incremental streaming). A subclass builds `input_embedding`,
    `spk_embed_affine_layer` and `decoder` (a `CausalCFM`), says its streaming chunk in tokens (`chunk_tokens`) and
    turns token ids into `mu` (`encode`)."""

    cfg: FlowConfig | FlowDiTConfig
    chunk_tokens: int
    input_embedding: nn.Embedding
    spk_embed_affine_layer: nn.Linear
    decoder: CausalCFM

    def fuse_projections_(self) -> FlowBase:
        """The estimator's projections that run together as one matmul each (its `fuse_projections_`): call after the
        last dtype/device move. Returns self."""
        self.decoder.estimator.fuse_projections_()
        return self

    def encode(self, ids: Tensor, real: Tensor | None, streaming: bool, carry: CarryBatch | None = None) -> Tensor:
        """Token ids [B,n+L] (each row's n tokens, then its look-ahead; `real` [B,n+L] bool marks the ids that
        exist, None = all) -> mu [B,80,2n]."""
        raise NotImplementedError

    def speaker(self, embedding: Tensor) -> Tensor:
        """[B,192] x-vector -> [B,80] `spks` (L2-normalised, then projected)."""
        return self.spk_embed_affine_layer(F.normalize(embedding.to(self.spk_embed_affine_layer.weight), dim=1))

    @staticmethod
    def _cond(prompt_feat: Tensor, start: int, n: int, like: Tensor) -> Tensor:
        """Frames start..start+n-1 of the condition: the prompt mel where it exists, zeros after. [B,80,n]"""
        feat = prompt_feat[:, start : start + n].transpose(1, 2).to(like)
        return F.pad(feat, (0, n - feat.shape[-1]))

    def _check_length(self, frames: int) -> None:
        if frames > self.cfg.noise_frames:
            raise InputError(f"prompt + speech is too long for the flow model: {frames} mel frames, the limit is "
                             f"{self.cfg.noise_frames} ({self.cfg.noise_frames // 50} s)")

    def prepare(
        self, token: Tensor, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor, streaming: bool,
        finalize: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Upstream's CFM inputs for prompt + tokens: (mu [1,80,T], cond [1,80,T], spks [1,80]). Without
        `finalize` the last 3 ids are look-ahead only."""
        ids = torch.cat((prompt_token.long(), token.long()), dim=1)
        la, real = self.cfg.pre_lookahead_len, None
        if finalize:
            real = (torch.arange(ids.shape[1] + la, device=ids.device) < ids.shape[1])[None]
            ids = F.pad(ids, (0, la))
        self._check_length(self.cfg.token_mel_ratio * (ids.shape[1] - la))
        mu = self.encode(ids, real, streaming)
        return mu, self._cond(prompt_feat, 0, mu.shape[-1], mu), self.speaker(embedding)

    @torch.inference_mode()
    def inference(
        self, token: Tensor, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor, streaming: bool = False,
        finalize: bool = True,
    ) -> Tensor:
        """Upstream `CausalMaskedDiffWithXvec.inference` (batch 1): token [1,N], prompt_token [1,P], prompt_feat
        [1,M,80], embedding [1,192] -> float32 mel [1,80,T-M] without the prompt frames."""
        mu, cond, spks = self.prepare(token, prompt_token, prompt_feat, embedding, streaming, finalize)
        feat = self.decoder.solve(self.decoder.noise(0, mu.shape[-1], mu), mu, spks, cond, streaming)
        return feat[:, :, prompt_feat.shape[1] :].float()

    @torch.inference_mode()
    def new_stream(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor) -> FlowStreamState:
        """A fresh per-request state; prompt_token [1,P] is encoded with the first chunk. The prompt may be on the
        CPU (the engine keeps it there, pinned on CUDA): it is copied to this model's device here, once per stream."""
        device = self.spk_embed_affine_layer.weight.device
        return FlowStreamState(
            spks=self.speaker(embedding.to(device, non_blocking=True)),
            prompt_feat=prompt_feat.to(device, non_blocking=True),
            pending=prompt_token.to(device, non_blocking=True).long(),
            steps=[Carry() for _ in self.decoder.steps],
        )

    def stream_chunk(
        self, state: FlowStreamState, new_tokens: Tensor, lookahead_tokens: Tensor | None = None,
        finalize: bool = False,
    ) -> Tensor:
        """`stream_chunks` for one stream."""
        return self.stream_chunks([state], [new_tokens], [lookahead_tokens], [finalize])[0]

    @torch.inference_mode()
    def stream_chunks(
        self, states: list[FlowStreamState], new_tokens: list[Tensor], lookahead: list[Tensor | None],
        finalize: list[bool],
    ) -> list[Tensor]:
        """The next chunk of each of several distinct streams, computed as one batch: per stream the mel
        [1,80,2n - dropped prompt frames] (float32) of its next n tokens new_tokens[i] [1,n], exactly what that
        stream's own call would return.

        A non-final chunk must end on a chunk boundary counted from the stream's first prompt token (the first
        chunk includes the prompt, so it holds P + pad + hop tokens with pad = ceil(P/25)·25 - P) and takes exactly
        3 look-ahead tokens (the tokens that follow; they are not consumed). A final chunk (`finalize`) may have
        any length; its end is padded with zeros like upstream's `finalize`. Every chunk is checked before any
        state changes.
        """
        batch = self.prepare_chunks(states, new_tokens, lookahead, finalize)
        feat = None
        if batch.states:
            carries = [CarryBatch([s.steps[k] for s in batch.states], batch.frames)
                       for k in range(len(self.decoder.steps))]
            feat = self.decoder.solve(batch.z, batch.mu, batch.spks, batch.cond, True, carries=carries)
        return self.finish_chunks(batch, feat)

    @torch.inference_mode()
    def prepare_chunks(
        self, states: list[FlowStreamState], new_tokens: list[Tensor], lookahead: list[Tensor | None],
        finalize: list[bool], encode: EncodeFn | None = None,
    ) -> ChunkBatch:
        """`stream_chunks` up to the CFM: checks every chunk, runs the encoder and builds the CFM inputs. The
        estimator's history is the caller's (`state.steps`, or a paged cache), and so is the encoder's when the caller
        brings `encode` (see `EncodeFn`); else the states' encoder carries hold it."""
        if not len(states) == len(new_tokens) == len(lookahead) == len(finalize):
            raise ValueError("stream_chunks needs one state, token chunk, look-ahead and finalize flag per stream")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a flow stream can appear only once in a batch")
        chunk, la = self.chunk_tokens, self.cfg.pre_lookahead_len
        rows = []
        for state, new, ahead, final in zip(states, new_tokens, lookahead, finalize, strict=True):
            if state.finished:
                raise ValueError("this flow stream is already finalized")
            tokens = torch.cat((state.pending, new.long()), dim=1)
            end = state.tokens + tokens.shape[1]
            if final:
                ahead = tokens[:, :0]
            elif ahead is None or ahead.shape[1] != la:
                raise ValueError(f"a non-final chunk needs exactly {la} look-ahead tokens")
            elif end % chunk:
                raise ValueError(f"a non-final chunk must end on a {chunk}-token boundary (prompt included): "
                                 f"it ends at {end}")
            self._check_length(self.cfg.token_mel_ratio * end)
            rows.append((tokens, ahead.long()))
        for state, (tokens, _), final in zip(states, rows, finalize, strict=True):
            state.pending, state.finished = tokens[:, :0], final
        live = [i for i, (tokens, _) in enumerate(rows) if tokens.shape[1]]
        return self._encode([states[i] for i in live], [rows[i] for i in live], live, len(rows), encode)

    def _encode(self, states: list[FlowStreamState], rows: list[tuple[Tensor, Tensor]], live: list[int],
                count: int, encode: EncodeFn | None) -> ChunkBatch:
        """Encoder over the (tokens [1,n], look-ahead [1,c]) rows, right-padded to the longest, + CFM inputs."""
        f0 = [s.frames for s in states]
        if not rows:
            empty = self.spk_embed_affine_layer.weight.new_zeros(0, self.cfg.output_size, 0)
            return ChunkBatch([], [], count, [], [], empty, empty, empty, empty.sum(-1))
        la, lengths = self.cfg.pre_lookahead_len, [tokens.shape[1] for tokens, _ in rows]
        width = max(lengths) + la
        ends = [tokens.shape[1] + ahead.shape[1] for tokens, ahead in rows]  # real ids per row
        ids = torch.cat([F.pad(torch.cat(row, dim=1), (0, width - end)) for row, end in zip(rows, ends, strict=True)])
        real = None
        if min(ends) < width:
            real = torch.arange(width, device=ids.device) < to_device(ends, ids.device)[:, None]
        if encode is None:
            mu = self.encode(ids, real, True, CarryBatch([s.encoder for s in states], lengths))
        else:
            mu = encode(states, ids, real, lengths)
            for s, n in zip(states, lengths, strict=True):
                s.encoder.pos += n
        per_token = mu.shape[-1] // max(lengths)
        frames = [per_token * n for n in lengths]

        def padded(t: Tensor) -> Tensor:
            return F.pad(t, (0, mu.shape[-1] - t.shape[-1]))

        cond = torch.cat([padded(self._cond(s.prompt_feat, f, m, mu)) for s, f, m in zip(states, f0, frames,
                                                                                          strict=True)])
        z = torch.cat([padded(self.decoder.noise(f, m, mu)) for f, m in zip(f0, frames, strict=True)])
        spks = torch.cat([s.spks for s in states])
        return ChunkBatch(states, live, count, f0, frames, z, mu, cond, spks)

    def finish_chunks(self, batch: ChunkBatch, feat: Tensor | None) -> list[Tensor]:
        """The CFM output feat [B',80,N'] (B' >= B rows, N' >= N frames; extra ones ignored) -> each stream's new
        mel without prompt frames (float32), in the call's order; the streams' frame counts advance."""
        out = [self.spk_embed_affine_layer.weight.new_zeros(1, self.cfg.output_size, 0, dtype=torch.float32)]
        out *= batch.count
        for row, (i, s, f, m) in enumerate(zip(batch.live, batch.states, batch.f0, batch.frames, strict=True)):
            out[i] = feat[row : row + 1, :, max(0, s.prompt_feat.shape[1] - f) : m].to(torch.float32, copy=True)
            s.frames = f + m
        return out


class Flow(FlowBase):
    """CosyVoice2's flow, upstream `CausalMaskedDiffWithXvec`: conformer encoder + U-Net estimator."""

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.chunk_tokens = cfg.encoder.static_chunk_size
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = CausalCFM(cfg, CausalConditionalDecoder(cfg.estimator))

    def encode(self, ids: Tensor, real: Tensor | None, streaming: bool, carry: CarryBatch | None = None) -> Tensor:
        x = self.input_embedding(ids.clamp(min=0))
        h = self.encoder(x, None if real is None else real[..., None].to(x), streaming, carry)
        return self.encoder_proj(h).transpose(1, 2)

    def stream_bytes_per_token(self, element_size: int) -> int:
        """Bytes a `FlowStreamState` grows by per token (2 mel frames) with elements of `element_size` bytes."""
        enc, est, ratio = self.cfg.encoder, self.cfg.estimator, self.cfg.token_mel_ratio
        est_blocks = (2 + est.num_mid_blocks) * est.n_blocks
        per_frame = len(self.decoder.steps) * 2 * est_blocks * est.channels[0] + enc.num_up_blocks * 2 * enc.output_size
        return element_size * (ratio * per_frame + enc.num_blocks * 2 * enc.output_size)
