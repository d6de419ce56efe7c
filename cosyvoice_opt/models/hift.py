"""HiFT vocoder (upstream `HiFTGenerator` + `ConvRNNF0Predictor`): mel -> f0 -> NSF excitation -> iSTFT waveform.

Module names and parameter layout follow upstream so `state_dict()` has exactly the keys of `hift.pt`
(weight-normed convs as `X.parametrizations.weight.original0/1`). Only the 24 kHz path (SineGen2) exists.
Given its random inputs (`SourceModule.draw`), `HiFT.inference` makes no host sync, so a CUDA graph can capture it
(`engine/hift_graphs.py`); that is why the inverse STFT is `istft` here rather than `torch.istft`.

The STFT of the excitation and the inverse STFT of the output use no FFT library: both are the exact DFT as one
matmul of the framed signal with a fixed cos/sin basis (`dft_bases`). A graph that replays a cuFFT plan breaks
when PyTorch's plan cache (an LRU) destroys that plan to make room for the plans of eager calls of other shapes;
a matmul replays no plan, so the graphs never depend on that cache. And HiFT's transform is tiny (`istft_n_fft`
points, 16 in CosyVoice2), which a matmul does cheaper than a cuFFT launch. Float32 stays float32 (the matmul
follows torch's float32 matmul precision: full fp32 unless TF32 matmuls are enabled).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from cosyvoice_opt.config import HiFTConfig


def normalize_hift_keys(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Map other spellings of hift.pt keys onto ours: drop `generator.` (HiFiGan training checkpoints, upstream
    removes every occurrence) and rename legacy weight norm `weight_g`/`weight_v` to `original0`/`original1`."""
    out = {}
    for key, value in sd.items():
        key = key.replace("generator.", "")
        if key.endswith(".weight_g"):
            key = key[: -len("weight_g")] + "parametrizations.weight.original0"
        elif key.endswith(".weight_v"):
            key = key[: -len("weight_v")] + "parametrizations.weight.original1"
        out[key] = value
    return out


_BASES: dict[tuple[int, torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}


def _build_dft_bases(n_fft: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    n_bins = n_fft // 2 + 1
    k = torch.arange(n_bins, dtype=torch.int64, device=device)
    n = torch.arange(n_fft, dtype=torch.int64, device=device)
    m = (k[:, None] * n[None, :]) % n_fft  # the angle in units of 2 pi / n_fft, reduced exactly
    angle = m.to(torch.float64) * (2 * math.pi / n_fft)
    quarter = (4 * m) % n_fft == 0  # multiples of pi/2: cos and sin are exactly 0 or +-1
    cos = torch.where(quarter, torch.cos(angle).round(), torch.cos(angle))
    sin = torch.where(quarter, torch.sin(angle).round(), torch.sin(angle))  # 0 for bin 0 and bin n_fft/2
    forward = torch.cat([cos, -sin])  # [2*n_bins, n_fft]: X[k] = sum_n x[n] e^{-2 pi i k n / N}
    weight = torch.full((n_bins, 1), 2.0, dtype=torch.float64, device=device)
    weight[0] = 1.0
    if n_fft % 2 == 0:
        weight[-1] = 1.0  # the Nyquist bin stands for itself only
    inverse = torch.cat([cos * weight, -sin * weight]) / n_fft  # [2*n_bins, n_fft], irfft(n=n_fft)'s sum
    return forward.to(dtype), inverse.to(dtype)


def dft_bases(n_fft: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(forward [2*(n_fft//2+1), n_fft], inverse [2*(n_fft//2+1), n_fft]) on `device` in `dtype`, made in float64
    and rounded once. `forward @ frame` is cat(real, imag) of the frame's one-sided DFT; `spec.T @ inverse` is
    `irfft(complex(real, imag), n=n_fft)` of cat(real, imag) `spec`: bins 0 and n_fft/2 weighted 1, the others 2,
    scaled by 1/n_fft, the imaginary parts of bins 0 and n_fft/2 ignored (their sin rows are exactly 0), as irfft.
    Made once per (n_fft, device, dtype) and kept, as normal tensors even under inference mode (so usable with
    autograd later), except while a CUDA graph is being captured: what a capture makes holds its values only when
    replayed, so it is made afresh inside the graph and not kept."""
    device = torch.device(device)
    key = (n_fft, device, dtype)
    bases = _BASES.get(key)
    if bases is None:
        with torch.inference_mode(False):
            bases = _build_dft_bases(n_fft, device, dtype)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _BASES[key] = bases
    return bases


def stft(x: Tensor, n_fft: int, hop: int, window: Tensor) -> Tensor:
    """cat(real, imag) along dim 1 of `torch.stft(x, n_fft, hop, n_fft, window, center=True, pad_mode="reflect",
    return_complex=True)` for x [B, L]: [B, 2*(n_fft//2+1), L//hop+1] (n_fft even). Reflect-padded by n_fft//2 each
    side, framed, windowed, then one matmul with the DFT basis."""
    padded = F.pad(x.unsqueeze(1), (n_fft // 2, n_fft // 2), mode="reflect").squeeze(1)
    frames = padded.unfold(-1, n_fft, hop) * window  # [B, frames, n_fft]
    forward, _ = dft_bases(n_fft, x.device, x.dtype)
    return torch.matmul(forward, frames.transpose(1, 2))


def istft(spec: Tensor, n_fft: int, hop: int, window: Tensor) -> Tensor:
    """`torch.istft(complex(real, imag), n_fft, hop, n_fft, window, center=True)` of spec = cat(real, imag)
    [B, 2*(n_fft//2+1), frames] (the layout `stft` returns) by its own steps: inverse real DFT as one matmul with
    the basis, window, overlap-add as `unfold_backward`, divided by the overlap-added squared window, n_fft//2
    trimmed each side. It leaves out torch.istft's check that the envelope is nowhere ~0, a host sync that a CUDA
    graph cannot capture; HiFT's periodic Hann at hop n_fft/4 never is (NOLA)."""
    _, inverse = dft_bases(n_fft, spec.device, spec.dtype)
    frames = torch.matmul(spec.transpose(1, 2), inverse) * window  # [B, frames, n_fft]
    n_frames = frames.shape[1]
    length = n_fft + hop * (n_frames - 1)
    wave = torch.ops.aten.unfold_backward(frames, [frames.shape[0], length], 1, n_fft, hop)
    envelope = torch.ops.aten.unfold_backward(window.pow(2).expand(1, n_frames, n_fft), [1, length], 1, n_fft, hop)
    keep = slice(n_fft // 2, length - n_fft // 2)
    return wave[:, keep] / envelope[:, keep]


class Snake(nn.Module):
    """x + sin^2(a x) / a with a per-channel linear-scale alpha."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        alpha = self.alpha[None, :, None]
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """Three (Snake, dilated conv, Snake, conv) residual units. `causal`: each conv pads (k-1)*dilation zeros on the
    left only (CosyVoice3's CausalHiFT), so an output sample depends on no later input."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...], causal: bool = False):
        super().__init__()
        k = kernel_size
        self.causal = causal
        self.convs1 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, k, dilation=d, padding=0 if causal else (k * d - d) // 2))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, k, padding=0 if causal else (k - 1) // 2)) for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def _conv(self, conv: nn.Conv1d, x: Tensor) -> Tensor:
        if self.causal:
            x = F.pad(x, ((conv.kernel_size[0] - 1) * conv.dilation[0], 0))
        return conv(x)

    def forward(self, x: Tensor) -> Tensor:
        units = zip(self.convs1, self.convs2, self.activations1, self.activations2, strict=True)
        for conv1, conv2, act1, act2 in units:
            x = x + self._conv(conv2, act2(self._conv(conv1, act1(x))))
        return x


class F0Predictor(nn.Module):
    """`ConvRNNF0Predictor`: 5 x (weight-normed conv k3, ELU), Linear -> |f0| in Hz per mel frame."""

    def __init__(self, in_channels: int, cond_channels: int, num_convs: int = 5):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(num_convs):
            layers += [weight_norm(nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1)),
                       nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: Tensor) -> Tensor:
        return self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1).abs()


class SourceModule(nn.Module):
    """NSF source (`SourceModuleHnNSF` with `SineGen2`): harmonic sines of f0 plus noise, merged by Linear + tanh."""

    def __init__(self, cfg: HiFTConfig):
        super().__init__()
        self.dim = cfg.nb_harmonics + 1
        self.scale = cfg.upsample_scale
        self.sampling_rate = cfg.sampling_rate
        self.sine_amp = cfg.nsf_alpha
        self.noise_std = cfg.nsf_sigma
        self.voiced_threshold = cfg.nsf_voiced_threshold
        self.l_linear = nn.Linear(self.dim, 1)

    def draw(self, b: int, length: int, generator: torch.Generator | None, **kw) -> tuple[Tensor, Tensor]:
        """The random inputs of `b` rows of `length` samples, in upstream's order: phases [b,dim] ~ U[0,1), then noise
        [b,length,dim] ~ N(0,1) filled in [b,dim,length] memory order like upstream's randn_like of its transposed
        sines (the CPU RNG yields other numbers for other layouts), then a [b,length,1] draw upstream makes and never
        uses: drawing it too keeps a seeded RNG in step with upstream across calls, so a seed reproduces its audio."""
        phases = torch.rand(b, self.dim, generator=generator, **kw)
        noise = torch.empty(b, self.dim, length, **kw).transpose(1, 2).normal_(generator=generator)
        torch.randn((b, length, 1), generator=generator, **kw)
        return phases, noise

    def forward(
        self, f0: Tensor, phases: Tensor | None = None, noise: Tensor | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> Tensor:
        """f0 [B,T] (Hz per frame) -> excitation [B,1,T*scale]. `phases` [B,dim] ~ U[0,1) and `noise` [B,L,dim]
        ~ N(0,1) are given together or drawn (`draw`) from `generator`: one for the batch (global RNG if None) or a
        list with one per row, so that a row's excitation does not depend on the rest of the batch."""
        if (phases is None) != (noise is None):
            raise ValueError("give both phases and noise, or neither")
        b = f0.shape[0]
        kw = {"device": f0.device, "dtype": f0.dtype}
        f0 = f0.repeat_interleave(self.scale, dim=1).unsqueeze(-1)  # nearest up-sampling, [B,L,1]
        if phases is None:
            rows = [(1, g) for g in generator] if isinstance(generator, list) else [(b, generator)]
            drawn = [self.draw(n, f0.shape[1], g, **kw) for n, g in rows]
            phases, noise = (torch.cat(t) for t in zip(*drawn, strict=True))
        fn = f0 * torch.arange(1, self.dim + 1, **kw)
        rad = (fn / self.sampling_rate) % 1
        phases = torch.cat([torch.zeros_like(phases[:, :1]), phases[:, 1:]], dim=1)  # fundamental starts at 0
        rad[:, 0] += phases
        # Integrate phase at frame rate, then interpolate back (SineGen2). The down-sampling reads mid-frame samples,
        # so the initial phases added at sample 0 have no effect, as upstream; they are drawn anyway (RNG in step).
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / self.scale, mode="linear")
        phase = torch.cumsum(rad, dim=2) * 2 * math.pi
        phase = F.interpolate(phase * self.scale, scale_factor=self.scale, mode="linear").transpose(1, 2)
        return self.excitation(torch.sin(phase) * self.sine_amp, f0, noise)

    def excitation(self, sines: Tensor, f0: Tensor, noise: Tensor) -> Tensor:
        """Harmonics `sines` [B,L,dim] kept where voiced (f0 [B,L,1] above the threshold), plus `noise` [B,L,dim]
        scaled by nsf_sigma where voiced and nsf_alpha/3 where not, merged by Linear + tanh -> [B,1,L]."""
        uv = (f0 > self.voiced_threshold).to(f0.dtype)
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        sines = sines * uv + noise_amp * noise
        return torch.tanh(self.l_linear(sines)).transpose(1, 2)


class HiFTBase(nn.Module):
    """What CosyVoice2's HiFT and CosyVoice3's CausalHiFT share: the STFT window, the source STFT, the last step
    (conv_post output -> magnitude and phase -> iSTFT -> clamp) and weight-norm fusing."""

    cfg: HiFTConfig

    def fuse_weight_norm(self) -> HiFTBase:
        """Replace every weight-norm parametrization by its plain weight (after loading; saves work per call).
        The state_dict keys become `X.weight` afterwards."""
        for module in self.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight")
        return self

    def stft_window(self, ref: Tensor) -> Tensor:
        """Periodic hann on `ref`'s device/dtype, made in float64 then rounded: bit-equal to upstream's scipy
        window. Made per call rather than a buffer so a model built on the meta device needs no re-init."""
        n = self.cfg.istft_n_fft
        return torch.hann_window(n, periodic=True, dtype=torch.float64, device=ref.device).to(ref.dtype)

    def source_stft(self, source: Tensor) -> Tensor:
        """source [B,1,L] -> cat(real, imag) of its STFT [B, n_fft+2, L/hop+1]."""
        n, hop = self.cfg.istft_n_fft, self.cfg.istft_hop
        return stft(source.squeeze(1), n, hop, self.stft_window(source))

    def spectrum_to_wave(self, x: Tensor) -> Tensor:
        """conv_post output [B, n_fft+2, frames] (log-magnitudes, then phases) -> waveform in
        [-audio_limit, audio_limit]: magnitude exp() clipped at 100, phase sin() (upstream's), inverse STFT."""
        cfg = self.cfg
        n_mag = cfg.istft_n_fft // 2 + 1
        magnitude = torch.exp(x[:, :n_mag]).clamp(max=1e2)
        phase = torch.sin(x[:, n_mag:])
        spec = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=1)
        wave = istft(spec, cfg.istft_n_fft, cfg.istft_hop, self.stft_window(magnitude))
        return wave.clamp(-cfg.audio_limit, cfg.audio_limit)


class HiFT(HiFTBase):
    """mel [B,80,T] -> waveform [B, T*upsample_scale] at `sampling_rate`."""

    def __init__(self, cfg: HiFTConfig):
        super().__init__()
        if cfg.sampling_rate == 22050:
            raise ValueError("the 22.05 kHz HiFT (SineGen) is not supported; CosyVoice2 uses 24 kHz")
        self.cfg = cfg
        base = cfg.base_channels
        n_bins = cfg.istft_n_fft + 2  # real + imag of n_fft // 2 + 1 bins
        n_stages = len(cfg.upsample_rates)
        self.m_source = SourceModule(cfg)
        self.conv_pre = weight_norm(nn.Conv1d(cfg.in_channels, base, 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(base // 2**i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True))
        )
        # Stage i sees the source STFT down-sampled by the product of the later up-sampling rates.
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        source_blocks = zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes, strict=True)
        for i, (k, d) in enumerate(source_blocks):
            ch = base // 2 ** (i + 1)
            rate = math.prod(cfg.upsample_rates[i + 1:])
            conv = nn.Conv1d(n_bins, ch, 1) if rate == 1 else nn.Conv1d(n_bins, ch, 2 * rate, rate, padding=rate // 2)
            self.source_downs.append(conv)
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, d)
            for i in range(n_stages)
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = weight_norm(nn.Conv1d(base // 2**n_stages, n_bins, 7, padding=3))
        self.f0_predictor = F0Predictor(cfg.in_channels, cfg.f0_cond_channels)

    def f0(self, mel: Tensor) -> Tensor:
        """mel [B,80,T] -> f0 [B,T] in Hz."""
        return self.f0_predictor(mel)

    def source(
        self, f0: Tensor, phases: Tensor | None = None, noise: Tensor | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> Tensor:
        """f0 [B,T] -> excitation [B,1,T*upsample_scale]; see `SourceModule.forward`."""
        return self.m_source(f0, phases, noise, generator)

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """mel [B,80,T], excitation [B,1,T*scale] -> waveform [B,T*scale] in [-audio_limit, audio_limit]."""
        cfg = self.cfg
        s = self.source_stft(source)
        x = self.conv_pre(mel)
        n_kernels = len(cfg.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, cfg.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s))
            x = sum(self.resblocks[i * n_kernels + j](x) for j in range(n_kernels)) / n_kernels
        return self.spectrum_to_wave(self.conv_post(F.leaky_relu(x)))  # default slope 0.01 here, as upstream

    def inference(
        self, mel: Tensor, cache_source: Tensor | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        phases: Tensor | None = None, noise: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """mel [B,80,T] -> (speech [B,L], excitation [B,1,L]). `cache_source` [B,1,S] replaces the first S
        excitation samples (the previous chunk's tail), which keeps phase continuous across streaming chunks.
        The random inputs are `phases` and `noise` if given (drawn beforehand, e.g. outside a CUDA graph), else
        drawn from `generator`: see `SourceModule.forward`. Runs in the parameters' dtype (fp32 like upstream)
        whatever the mel's."""
        mel = mel.to(self.conv_pre.bias.dtype)
        source = self.source(self.f0(mel), phases, noise, generator)
        if cache_source is not None and cache_source.shape[-1] > 0:
            source = torch.cat([cache_source.to(source.dtype), source[..., cache_source.shape[-1]:]], dim=-1)
        return self.decode(mel, source), source
