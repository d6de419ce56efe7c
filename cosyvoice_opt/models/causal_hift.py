"""CosyVoice3's vocoder (upstream `CausalHiFTGenerator` + `CausalConvRNNF0Predictor`): HiFT made causal.

Every convolution pads on the left only, except two that look ahead: conv_pre sees `conv_pre_look_right` (4) later
mel frames and the f0 predictor's first conv 3. Up-sampling is nearest-neighbour then a left-padded conv, not a
transposed conv. A call that is not the last (`finalize=False`) takes the last 3 mel frames as the f0 predictor's
right context and the 4 before them as conv_pre's, and returns the waveform of all but the last 8 frames; those
samples equal the first ones of a final call on any longer mel. `stream` uses that: each chunk computes its new
samples from a bounded left context (`decode_context_frames`), where upstream re-runs the whole utterance per chunk.

Module names and the parameter layout follow upstream, so `state_dict()` has exactly the keys of CosyVoice3's
`hift.pt` (weight norm as `X.parametrizations.weight.original0/1`).

Upstream quirks, reproduced by default; each has a switch in `CausalHiFTConfig` (off = the fix):
* `staircase_source`: the harmonic phase is integrated per mel frame, multiplied by the 480 samples of a frame and
  up-sampled by nearest neighbour, so each harmonic is a constant over a frame (a staircase), not a sinusoid.
  Off: the phase grows sample by sample at f0 * h (it meets the staircase at each frame's last sample).
* `fixed_noise`: the noise is uniform in [0, 1) (not zero-mean), drawn once at construction from the global RNG
  (`torch.rand(1, 9)`, then `torch.rand(1, 7200000, 9)`), and every call reuses its first rows: sample n of any
  utterance gets row n. Only the prefix a call needs is drawn (the CPU generator gives the same first rows for any
  length), from `noise_seed` (the parity fixtures seed right before construction) or, by default, from the state
  upstream's loader leaves the RNG in (`loader_rng_state`). Off: zero-mean Gaussian noise, as in training, drawn
  per call from the caller's generator.
* `f0_float64`: the f0 predictor runs in float64, its weight-normed weights formed from float64 g and v, and f0 is
  cast back to float32. The waveform moves by ~1e-3 without it (the error accumulates in the source phase). Off: the
  predictor runs in the parameters' dtype.
The phase integral is a float64 running sum rounded per frame, which is what upstream's float32 `cumsum` does on the
CPU; a stream carries that sum from chunk to chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from cosyvoice_opt.config import CausalHiFTConfig
from cosyvoice_opt.models.hift import HiFTBase, ResBlock, SourceModule

F0_LOOK_RIGHT = 3  # the f0 predictor's first conv: kernel 4, padded on the right (upstream's constant)


def weight_in(module: nn.Module, dtype: torch.dtype) -> Tensor:
    """`module`'s weight in `dtype`. A weight-normed one is formed from g and v cast to `dtype` first (upstream casts
    the whole predictor to float64 before forming it); a plain (fused) one is cast."""
    if parametrize.is_parametrized(module, "weight"):
        originals = module.parametrizations.weight
        g, v = originals.original0, originals.original1
        return torch._weight_norm(v.to(dtype), g.to(dtype), 0)
    return module.weight.to(dtype)


class CausalF0Predictor(nn.Module):
    """`CausalConvRNNF0Predictor`: a conv seeing 3 later frames, 4 left-causal convs (all weight-normed, each
    followed by ELU), Linear -> |f0| in Hz per mel frame."""

    def __init__(self, in_channels: int, cond_channels: int, num_convs: int = 5):
        super().__init__()
        layers: list[nn.Module] = [weight_norm(nn.Conv1d(in_channels, cond_channels, F0_LOOK_RIGHT + 1)), nn.ELU()]
        for _ in range(num_convs - 1):
            layers += [weight_norm(nn.Conv1d(cond_channels, cond_channels, 3)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    @property
    def left_context(self) -> int:
        """Earlier mel frames an f0 frame depends on."""
        return sum(conv.kernel_size[0] - 1 for conv in list(self.condnet)[2::2])

    def forward(self, mel: Tensor, finalize: bool = True, dtype: torch.dtype | None = None) -> Tensor:
        """mel [B,80,T] -> f0 [B,T] (`finalize`: zeros after the end) or [B,T-3] (the last 3 frames are only right
        context), computed in `dtype` (default the parameters')."""
        dtype = dtype or self.classifier.weight.dtype
        x = mel.to(dtype)
        if finalize:
            x = F.pad(x, (0, F0_LOOK_RIGHT))
        for i, conv in enumerate(self.condnet[::2]):
            if i > 0:
                x = F.pad(x, (conv.kernel_size[0] - 1, 0))
            x = F.elu(F.conv1d(x, weight_in(conv, dtype), conv.bias.to(dtype)))
        f0 = F.linear(x.transpose(1, 2), weight_in(self.classifier, dtype), self.classifier.bias.to(dtype))
        return f0.squeeze(-1).abs()


def loader_rng_state(cfg: CausalHiFTConfig) -> Tensor:
    """The CPU RNG state upstream's CosyVoice3 loader reaches right before the HiFT draws its noise: the flow's
    `CausalConditionalCFM` reseeds with 0 and draws its fixed noise [1,80,15000]; the flow builds its token embedding
    (6561 x 80) and speaker projection (192 -> 80); the f0 predictor is built; each with torch's default
    initialisers (the released flow's shapes; cosyvoice3-reference.md 8.2)."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(0)
        torch.randn(1, 80, 15000)
        nn.Embedding(6561, 80)
        nn.Linear(192, 80)
        CausalF0Predictor(cfg.in_channels, cfg.f0_cond_channels)
        return torch.get_rng_state()


def fixed_noise(rng_state: Tensor | int, samples: int, dim: int) -> Tensor:
    """The first `samples` rows [1, samples, dim] of upstream's construction-time noise: from the RNG state (or
    after `manual_seed(seed)`), `rand(1, dim)` (the unused initial phases), then `rand(1, N, dim)` for upstream's
    N >= samples."""
    generator = torch.Generator()
    if isinstance(rng_state, int):
        generator.manual_seed(rng_state)
    else:
        generator.set_state(rng_state)
    torch.rand(1, dim, generator=generator)
    return torch.rand(1, samples, dim, generator=generator)


class CausalSourceModule(SourceModule):
    """`SourceModuleHnNSF` with `SineGen2(causal=True)`: the harmonic source of f0 frames starting at any frame,
    with its phase sum carried in from the frames before."""

    def __init__(self, cfg: CausalHiFTConfig):
        super().__init__(cfg)
        self.cfg = cfg
        self._noise: Tensor | None = None  # the fixed noise's prefix drawn so far (not in the state dict)
        self._loader_state: Tensor | None = None

    def noise_rows(self, start: int, stop: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """Rows [start, stop) of the fixed noise [1, stop-start, dim]; draws a longer prefix when needed."""
        cfg = self.cfg
        if stop > cfg.noise_samples:
            raise ValueError(
                f"CausalHiFT's fixed noise covers {cfg.noise_samples} samples "
                f"({cfg.noise_samples / cfg.sampling_rate:g} s); this audio needs {stop}"
            )
        if self._noise is None or self._noise.shape[1] < stop:
            have = 0 if self._noise is None else self._noise.shape[1]
            rows = min(cfg.noise_samples, max(stop, 2 * have, 30 * cfg.sampling_rate))
            if cfg.noise_seed is None and self._loader_state is None:
                self._loader_state = loader_rng_state(cfg)
            self._noise = fixed_noise(cfg.noise_seed if cfg.noise_seed is not None else self._loader_state, rows,
                                      self.dim)
        if self._noise.device != device:
            self._noise = self._noise.to(device)
        return self._noise[:, start:stop].to(dtype)

    def forward(
        self, f0: Tensor, start: int = 0, cycles: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """f0 [B,n] (Hz) of frames start..start+n-1 -> (excitation [B,1,n*scale], phase sum [B,dim] float64 in
        cycles after the last frame). `cycles` is that sum after frame start-1 (zeros at the start)."""
        b, n = f0.shape
        scale = self.scale
        kw = {"device": f0.device, "dtype": f0.dtype}
        rad = (f0.unsqueeze(-1) * torch.arange(1, self.dim + 1, **kw) / self.sampling_rate) % 1  # [B,n,dim]
        if cycles is None:
            cycles = torch.zeros(b, self.dim, device=f0.device, dtype=torch.float64)
        running = torch.cumsum(torch.cat([cycles.unsqueeze(1), rad.to(torch.float64)], dim=1), dim=1)
        if self.cfg.staircase_source:
            phase = running[:, 1:].to(f0.dtype) * 2 * math.pi * scale  # upstream's float32 ops, in its order
            sines = torch.sin(phase).repeat_interleave(scale, dim=1)
        else:
            steps = torch.arange(1, scale + 1, device=f0.device, dtype=torch.float64)[:, None]
            frac = (running[:, :-1, None] * scale + steps * rad.to(torch.float64)[:, :, None]) % 1  # [B,n,scale,dim]
            sines = torch.sin(frac * 2 * math.pi).to(f0.dtype).reshape(b, n * scale, self.dim)
        if self.cfg.fixed_noise:
            noise = self.noise_rows(start * scale, (start + n) * scale, f0.device, f0.dtype).expand(b, -1, -1)
        else:
            noise = torch.randn(b, n * scale, self.dim, generator=generator, **kw)
        f0 = f0.repeat_interleave(scale, dim=1).unsqueeze(-1)
        return self.excitation(sines * self.sine_amp, f0, noise), running[:, -1]


@dataclass
class CausalHiFTStream:
    """One utterance's state between `CausalHiFT.stream` calls: the mel and excitation tails later chunks still
    need, how far f0/excitation and waveform have got (in mel frames), and the carried phase sum."""

    generator: torch.Generator | None = None  # Gaussian noise when `fixed_noise` is off
    mel: Tensor | None = None
    mel_start: int = 0  # frame index of mel[..., 0]
    source: Tensor | None = None
    source_start: int = 0  # frame index of the excitation tail's first sample
    cycles: Tensor | None = None
    f0_frames: int = 0
    emitted_frames: int = 0
    finished: bool = False


class CausalHiFT(HiFTBase):
    """mel [B,80,T] -> waveform [B, T*upsample_scale] at `sampling_rate`, causal with a 4+3+1 frame look-ahead."""

    def __init__(self, cfg: CausalHiFTConfig):
        super().__init__()
        if cfg.sampling_rate == 22050:
            raise ValueError("the 22.05 kHz HiFT (SineGen) is not supported; CosyVoice3 uses 24 kHz")
        self.cfg = cfg
        base = cfg.base_channels
        n_bins = cfg.istft_n_fft + 2
        self.m_source = CausalSourceModule(cfg)
        self.conv_pre = weight_norm(nn.Conv1d(cfg.in_channels, base, cfg.conv_pre_look_right + 1))
        self.ups = nn.ModuleList(
            weight_norm(nn.Conv1d(base // 2**i, base // 2 ** (i + 1), k))
            for i, k in enumerate(cfg.upsample_kernel_sizes)
        )
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        source_blocks = zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes, strict=True)
        for i, (k, d) in enumerate(source_blocks):
            ch = base // 2 ** (i + 1)
            rate = math.prod(cfg.upsample_rates[i + 1:])  # STFT frames per frame of this stage
            self.source_downs.append(nn.Conv1d(n_bins, ch, 1) if rate == 1 else nn.Conv1d(n_bins, ch, 2 * rate, rate))
            self.source_resblocks.append(ResBlock(ch, k, d, causal=True))
        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, d, causal=True)
            for i in range(len(cfg.upsample_rates))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = weight_norm(nn.Conv1d(base // 2 ** len(cfg.upsample_rates), n_bins, 7))
        self.f0_predictor = CausalF0Predictor(cfg.in_channels, cfg.f0_cond_channels)

    @property
    def hold_back_frames(self) -> int:
        """Mel frames at the end whose waveform a non-final call leaves out: the look-aheads and one frame."""
        return F0_LOOK_RIGHT + self.cfg.conv_pre_look_right + 1

    def fuse_weight_norm(self) -> CausalHiFT:
        """As `HiFTBase.fuse_weight_norm`; with `f0_float64` the predictor is made float64 first, so its fused
        weights are the float64 ones upstream forms."""
        if self.cfg.f0_float64:
            self.f0_predictor.to(torch.float64)
        super().fuse_weight_norm()
        return self

    def f0(self, mel: Tensor, finalize: bool = True) -> Tensor:
        """mel [B,80,T] -> f0 [B,T] (`finalize`) or [B,T-3] in Hz, in the mel's dtype (computed in float64 with
        `f0_float64`, as upstream)."""
        dtype = torch.float64 if self.cfg.f0_float64 else None
        return self.f0_predictor(mel, finalize, dtype).to(mel.dtype)

    def source(
        self, f0: Tensor, start: int = 0, cycles: Tensor | None = None, generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """f0 [B,n] of frames from `start` -> (excitation [B,1,n*scale], phase sum); see `CausalSourceModule`."""
        return self.m_source(f0, start, cycles, generator)

    def decode(self, mel: Tensor, source: Tensor, finalize: bool = True) -> Tensor:
        """mel [B,80,T], excitation [B,1,T*scale] -> waveform [B,T*scale] (`finalize`: zeros after the end), or
        [B,(T-conv_pre_look_right-1)*scale] when not final: the last conv_pre_look_right frames are only right
        context and one more frame is held back (the inverse STFT's overlap)."""
        cfg = self.cfg
        look = cfg.conv_pre_look_right
        s = self.source_stft(source)
        if finalize:
            mel = F.pad(mel, (0, look))
        else:
            s = s[..., : -look * (cfg.upsample_scale // cfg.istft_hop)]
        x = self.conv_pre(mel)
        n_kernels = len(cfg.resblock_kernel_sizes)
        for i, (up, rate) in enumerate(zip(self.ups, cfg.upsample_rates, strict=True)):
            x = F.leaky_relu(x, cfg.lrelu_slope).repeat_interleave(rate, dim=-1)
            x = up(F.pad(x, (up.kernel_size[0] - 1, 0)))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            down = self.source_downs[i]
            x = x + self.source_resblocks[i](down(F.pad(s, (down.stride[0] - 1, 0))))
            x = sum(self.resblocks[i * n_kernels + j](x) for j in range(n_kernels)) / n_kernels
        x = F.leaky_relu(x)  # default slope 0.01 here, as upstream
        wave = self.spectrum_to_wave(self.conv_post(F.pad(x, (self.conv_post.kernel_size[0] - 1, 0))))
        return wave if finalize else wave[:, : -cfg.upsample_scale]

    def inference(
        self, mel: Tensor, finalize: bool = True, generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """mel [B,80,T] -> (speech [B,T*scale], excitation [B,1,T*scale]) or, not final, (speech [B,(T-8)*scale],
        excitation [B,1,(T-3)*scale]), as upstream's `inference(speech_feat, finalize)`. Runs in the parameters'
        dtype (fp32 like upstream) whatever the mel's."""
        mel = mel.to(self.conv_pre.bias.dtype)
        source, _ = self.source(self.f0(mel, finalize), generator=generator)
        return self.decode(mel if finalize else mel[..., :-F0_LOOK_RIGHT], source, finalize), source

    def decode_context_frames(self) -> int:
        """Earlier mel frames (a bound) that the decode's output frame depends on through its left-padded convs,
        the source STFT's reflection at the start and the inverse STFT's overlap: a decode started that many frames
        earlier gives the same samples as one started at the utterance's start."""
        cfg = self.cfg
        frames_per_stft = cfg.istft_n_fft // cfg.istft_hop  # STFT frames one sample is in
        per_frame = cfg.upsample_scale // cfg.istft_hop  # STFT frames per mel frame

        def resblock_span(block: ResBlock) -> int:
            return sum((c.kernel_size[0] - 1) * c.dilation[0] for c in [*block.convs1, *block.convs2])

        reach, stage_rate = 0.0, 1
        n_kernels = len(cfg.resblock_kernel_sizes)
        for i, (up, rate) in enumerate(zip(self.ups, cfg.upsample_rates, strict=True)):
            stage_rate *= rate
            reach += (up.kernel_size[0] - 1 + (i == len(self.ups) - 1)) / stage_rate
            down = self.source_downs[i]
            source_reach = (frames_per_stft + down.kernel_size[0]) / per_frame
            source_reach += resblock_span(self.source_resblocks[i]) / stage_rate
            reach = max(reach, source_reach)
            reach += max(resblock_span(b) for b in self.resblocks[i * n_kernels:(i + 1) * n_kernels]) / stage_rate
        reach += (self.conv_post.kernel_size[0] - 1 + frames_per_stft) / per_frame
        return math.ceil(reach) + 1

    def new_stream(self, generator: torch.Generator | None = None) -> CausalHiFTStream:
        """The state of a new utterance for `stream` (`generator`: Gaussian noise when `fixed_noise` is off)."""
        return CausalHiFTStream(generator=generator)

    def stream(self, state: CausalHiFTStream, mel: Tensor, finalize: bool) -> Tensor:
        """Append mel frames [B,80,n] to the utterance and return its new waveform samples [B,·]: up to 8 frames
        before the end while not `finalize`, all of it at the final call. The samples equal those of upstream's
        `inference` re-run over all the mel so far, but each call computes only its new frames from a bounded left
        context: f0 from `f0_predictor.left_context` earlier frames, the decode from `decode_context_frames`, the
        excitation's phase from the carried sum."""
        if state.finished:
            raise ValueError("this CausalHiFT stream is finished: start a new one with new_stream()")
        mel = mel.to(self.conv_pre.bias.dtype)
        if state.mel is not None:
            mel = torch.cat([state.mel, mel], dim=-1)
        total = state.mel_start + mel.shape[-1]
        scale = self.cfg.upsample_scale
        f0_end = total if finalize else max(state.f0_frames, total - F0_LOOK_RIGHT)
        if f0_end > state.f0_frames:
            start = max(0, state.f0_frames - self.f0_predictor.left_context)
            f0 = self.f0(mel[..., start - state.mel_start:], finalize)[:, state.f0_frames - start:]
            source, state.cycles = self.source(f0, state.f0_frames, state.cycles, state.generator)
            state.source = source if state.source is None else torch.cat([state.source, source], dim=-1)
            state.f0_frames = f0_end
        end = total if finalize else total - self.hold_back_frames
        out = mel.new_zeros(mel.shape[0], 0)
        if end > state.emitted_frames:
            first = max(0, state.emitted_frames - self.decode_context_frames())
            window = mel[..., first - state.mel_start: f0_end - state.mel_start]
            wave = self.decode(window, state.source[..., (first - state.source_start) * scale:], finalize)
            out = wave[:, (state.emitted_frames - first) * scale:]
            state.emitted_frames = end
        # Keep only what the next call reads.
        keep_source = max(0, state.emitted_frames - self.decode_context_frames())
        keep_mel = min(keep_source, max(0, state.f0_frames - self.f0_predictor.left_context))
        state.source = state.source[..., (keep_source - state.source_start) * scale:] if state.source is not None \
            else None
        state.source_start = keep_source
        state.mel, state.mel_start = mel[..., keep_mel - state.mel_start:], keep_mel
        state.finished = finalize
        return out
