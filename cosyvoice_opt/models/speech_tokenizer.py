"""The speech tokenizer (S3Tokenizer v2) as a PyTorch module: whisper log-mel -> 25 Hz speech token ids.

Upstream runs `speech_tokenizer_v2.onnx` in onnxruntime on one CPU thread. The same network here runs on the GPU,
several prompts in one padded batch. Its weights come from that file (`checkpoint.read_speech_tokenizer`).

Two stride-2 GELU convs, then pre-norm blocks of rotary multi-head attention with an FSMN memory (a depthwise conv
over the values, added to the attention's output) and a GELU MLP, then an FSQ of 8 dims and 3 levels: each dim is
rounded to {-1, 0, 1} and the digits read in base 3 give an id in [0, 6561).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FSQ_SCALE = 0.999  # the released network scales tanh by this before rounding (float32: 0.9990000128746033)


@dataclass(frozen=True)
class SpeechTokenizerConfig:
    n_mels: int = 128
    width: int = 1280
    heads: int = 20
    layers: int = 6
    hidden: int = 5120
    fsmn_taps: int = 31
    fsq_dims: int = 8
    attn_ln_eps: float = 1e-6
    mlp_ln_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


def token_lengths(frames: Tensor) -> Tensor:
    """Ids per prompt after the two stride-2 convs (kernel 3, padding 1): `((T + 1) // 2 + 1) // 2`."""
    return ((frames + 1) // 2 + 1) // 2


def rotate_half(x: Tensor) -> Tensor:
    left, right = x.chunk(2, dim=-1)
    return torch.cat((-right, left), dim=-1)


class FSMNAttention(nn.Module):
    """Multi-head attention with rotary positions on q and k, plus the FSMN memory of the values."""

    def __init__(self, cfg: SpeechTokenizerConfig):
        super().__init__()
        self.heads = cfg.heads
        self.query = nn.Linear(cfg.width, cfg.width)
        self.key = nn.Linear(cfg.width, cfg.width, bias=False)
        self.value = nn.Linear(cfg.width, cfg.width)
        self.out = nn.Linear(cfg.width, cfg.width)
        self.fsmn_block = nn.Conv1d(cfg.width, cfg.width, cfg.fsmn_taps, groups=cfg.width, bias=False)
        left = (cfg.fsmn_taps - 1) // 2
        self.pads = (left, cfg.fsmn_taps - 1 - left)  # same-length output, centred

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keep: Tensor) -> Tensor:
        """x `[B, T, W]`; cos/sin `[T, 1, D]`; keep `[B, T]` bool (False on padding)."""
        b, t, w = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1) for p in (self.query, self.key, self.value))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        v_rows = v.reshape(b, t, w) * keep[..., None]
        memory = self.fsmn_block(F.pad(v_rows.transpose(1, 2), self.pads)).transpose(1, 2)
        memory = (memory + v_rows) * keep[..., None]
        ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=keep[:, None, None, :])
        return self.out(ctx.transpose(1, 2).reshape(b, t, w)) + memory


class TokenizerBlock(nn.Module):
    def __init__(self, cfg: SpeechTokenizerConfig):
        super().__init__()
        self.attn_ln = nn.LayerNorm(cfg.width, eps=cfg.attn_ln_eps)
        self.attn = FSMNAttention(cfg)
        self.mlp_ln = nn.LayerNorm(cfg.width, eps=cfg.mlp_ln_eps)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, cfg.hidden), nn.GELU(), nn.Linear(cfg.hidden, cfg.width))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keep: Tensor) -> Tensor:
        x = x + self.attn(self.attn_ln(x), cos, sin, keep)
        return x + self.mlp(self.mlp_ln(x))


class SpeechTokenizerV2(nn.Module):
    def __init__(self, cfg: SpeechTokenizerConfig):
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.width, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(cfg.width, cfg.width, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(TokenizerBlock(cfg) for _ in range(cfg.layers))
        self.project_down = nn.Linear(cfg.width, cfg.fsq_dims)
        self.register_buffer("powers", 3 ** torch.arange(cfg.fsq_dims), persistent=False)

    def _rotary(self, t: int, device: torch.device) -> tuple[Tensor, Tensor]:
        d = self.cfg.head_dim
        freqs = 1.0 / self.cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(t, device=device, dtype=torch.float32), freqs).repeat(1, 2)[:, None, :]
        return angles.cos(), angles.sin()

    def encode(self, mel: Tensor, frames: Tensor) -> Tensor:
        """mel `[B, n_mels, T]` (padded), frames `[B]` -> the FSQ's scaled values `[B, n, fsq_dims]` in (-1, 1);
        rows past a prompt's own `token_lengths` are padding."""
        t = mel.shape[-1]
        keep = torch.arange(t, device=mel.device) < frames[:, None]
        x = F.gelu(self.conv1(mel * keep[:, None]))
        lengths = (frames + 1) // 2
        keep = torch.arange(x.shape[-1], device=mel.device) < lengths[:, None]
        x = F.gelu(self.conv2(x * keep[:, None])).transpose(1, 2)
        keep = torch.arange(x.shape[1], device=mel.device) < token_lengths(frames)[:, None]
        cos, sin = self._rotary(x.shape[1], mel.device)
        for block in self.blocks:
            x = block(x, cos, sin, keep)
        return torch.tanh(self.project_down(x).float()) * FSQ_SCALE

    def quantize(self, values: Tensor) -> Tensor:
        """FSQ values `[..., fsq_dims]` -> ids `[...]` int32: each dim rounded to a digit in {0, 1, 2}, base 3."""
        return ((values.round() + 1) * self.powers).sum(-1).int()

    def forward(self, mel: Tensor, frames: Tensor) -> Tensor:
        """mel `[B, n_mels, T]`, frames `[B]` -> ids `[B, n]` int32 (read each row's first `token_lengths`)."""
        return self.quantize(self.encode(mel, frames))
