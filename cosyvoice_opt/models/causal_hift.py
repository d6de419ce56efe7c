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
from dataclasses import dataclass, field

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
        generator: torch.Generator | None = None, noise: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """f0 [B,n] (Hz) of frames start..start+n-1 -> (excitation [B,1,n*scale], phase sum [B,dim] float64 in
        cycles after the last frame). `cycles` is that sum after frame start-1 (zeros at the start). `noise`
        [B,n*scale,dim], if given, is used as this call's noise (`noise` below, drawn beforehand: a CUDA graph
        cannot draw it), else it is drawn here."""
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
        if noise is None:
            noise = self.noise(b, start, n, generator, f0.device, f0.dtype)
        f0 = f0.repeat_interleave(scale, dim=1).unsqueeze(-1)
        return self.excitation(sines * self.sine_amp, f0, noise), running[:, -1]

    def noise(self, b: int, start: int, n: int, generator: torch.Generator | None, device: torch.device,
              dtype: torch.dtype) -> Tensor:
        """The noise [b, n*scale, dim] of frames start..start+n-1: the fixed noise's rows of those samples, or (with
        `fixed_noise` off) a Gaussian draw from `generator`."""
        scale = self.scale
        if self.cfg.fixed_noise:
            return self.noise_rows(start * scale, (start + n) * scale, device, dtype).expand(b, -1, -1)
        return torch.randn(b, n * scale, self.dim, generator=generator, device=device, dtype=dtype)


@dataclass
class CausalHiFTStream:
    """One utterance's state between `CausalHiFT.stream` calls: the mel and excitation tails later chunks still
    need, how far the mel, f0/excitation and waveform have got (in mel frames), and the carried phase sum."""

    generator: torch.Generator | None = None  # Gaussian noise when `fixed_noise` is off
    mel: Tensor | None = None  # frames mel_start..received-1
    mel_start: int = 0  # frame index of mel[..., 0]
    received: int = 0  # mel frames given so far
    source: Tensor | None = None  # excitation of frames source_start..f0_frames-1
    source_start: int = 0  # frame index of the excitation tail's first sample
    cycles: Tensor | None = None
    f0_frames: int = 0
    emitted_frames: int = 0
    finished: bool = False


@dataclass(frozen=True, order=True)
class StreamStep:
    """What one `CausalHiFT.stream` call computes, as offsets into its inputs: the mel it reads (the state's tail and
    the new frames, `frames` of them) and the carried excitation (`tail` frames). Equal steps run the same ops on the
    same shapes (`stream_compute`), whatever the stream's position, so several streams' equal steps make one batch.
    The fields after `finalize` are the stream's absolute position (not part of the comparison)."""

    frames: int
    tail: int
    f0_from: int  # first mel frame the f0 predictor reads
    f0_skip: int  # its first f0 frames, already turned into excitation by earlier calls
    f0_new: int  # new f0 (and excitation) frames; 0: none
    window_from: int  # the decode's mel window ...
    window_to: int  # ... (window_from == window_to: no decode)
    source_from: int  # first frame of (carried ++ new) excitation the decode reads
    out_from: int  # decoded frames before the new samples
    source_keep: int  # first frame of (carried ++ new) excitation kept for later calls
    finalize: bool
    noise_from: int = field(default=0, compare=False)  # frame index of the first new f0 frame (its noise rows)
    mel_keep: int = field(default=0, compare=False)  # first mel frame kept for later calls
    after: tuple[int, int, int, int, int] = field(default=(0, 0, 0, 0, 0), compare=False)
    # (received, mel_start, source_start, f0_frames, emitted_frames) once this call ran


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
        self._context_frames = self._decode_context()  # the geometry's; every stream step reads it

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
        noise: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """f0 [B,n] of frames from `start` -> (excitation [B,1,n*scale], phase sum); see `CausalSourceModule`."""
        return self.m_source(f0, start, cycles, generator, noise)

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
        return self._context_frames

    def _decode_context(self) -> int:
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
        excitation's phase from the carried sum. In three parts, so that the engine can batch the middle one of
        several streams (`engine/causal_streaming.py`): `stream_step` (positions only), `stream_compute` (the fixed
        shape work) and `stream_advance`."""
        step = self.stream_step(state, mel.shape[-1], finalize)
        mel = self.stream_mel(state, mel)
        noise = self.m_source.noise(mel.shape[0], step.noise_from, step.f0_new, state.generator, mel.device,
                                    mel.dtype) if step.f0_new else None
        wave, source, cycles = self.stream_compute(step, mel, state.source, state.cycles, noise)
        self.stream_advance(state, step, mel, source, cycles)
        return wave

    def stream_step(self, state: CausalHiFTStream, frames: int, finalize: bool) -> StreamStep:
        """The step of a `stream` call that appends `frames` mel frames (reads only the state's positions)."""
        if state.finished:
            raise ValueError("this CausalHiFT stream is finished: start a new one with new_stream()")
        ctx, left = self.decode_context_frames(), self.f0_predictor.left_context
        total = state.received + frames
        f0_end = total if finalize else max(state.f0_frames, total - F0_LOOK_RIGHT)
        f0_from = max(0, state.f0_frames - left)
        end = total if finalize else total - self.hold_back_frames
        first = max(0, state.emitted_frames - ctx)
        emitted = max(end, state.emitted_frames)
        keep_source = max(0, emitted - ctx)
        keep_mel = min(keep_source, max(0, f0_end - left))
        new, decode = f0_end > state.f0_frames, end > state.emitted_frames
        ms, ss = state.mel_start, state.source_start
        return StreamStep(
            frames=total - ms, tail=state.f0_frames - ss,
            f0_from=f0_from - ms if new else 0, f0_skip=state.f0_frames - f0_from if new else 0,
            f0_new=f0_end - state.f0_frames,
            window_from=first - ms if decode else 0, window_to=f0_end - ms if decode else 0,
            source_from=first - ss if decode else 0, out_from=state.emitted_frames - first if decode else 0,
            source_keep=keep_source - ss, finalize=finalize, noise_from=state.f0_frames, mel_keep=keep_mel - ms,
            after=(total, keep_mel, keep_source, f0_end, emitted),
        )

    def stream_mel(self, state: CausalHiFTStream, mel: Tensor) -> Tensor:
        """The mel a step reads: the state's tail ++ the new frames, in the parameters' dtype."""
        mel = mel.to(self.conv_pre.bias.dtype)
        return mel if state.mel is None else torch.cat([state.mel, mel], dim=-1)

    def stream_compute(self, step: StreamStep, mel: Tensor, source: Tensor | None, cycles: Tensor | None,
                       noise: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The work of a step, shapes fixed by it and no host sync (a CUDA graph can capture it): mel [B,80,frames],
        the carried excitation [B,1,tail*scale] (None without one) and phase sum [B,dim] float64 (None: zeros), the
        new frames' noise [B,f0_new*scale,dim] -> (new samples [B,·], excitation to carry, phase sum to carry)."""
        scale = self.cfg.upsample_scale
        if step.f0_new:
            f0 = self.f0(mel[..., step.f0_from:], step.finalize)[:, step.f0_skip:]
            new, cycles = self.source(f0, cycles=cycles, noise=noise)
            source = new if source is None else torch.cat([source, new], dim=-1)
        wave = mel.new_zeros(mel.shape[0], 0)
        if step.window_to > step.window_from:
            window = mel[..., step.window_from:step.window_to]
            wave = self.decode(window, source[..., step.source_from * scale:], step.finalize)
            wave = wave[:, step.out_from * scale:]
        return wave, None if source is None else source[..., step.source_keep * scale:], cycles

    def stream_advance(self, state: CausalHiFTStream, step: StreamStep, mel: Tensor, source: Tensor | None,
                       cycles: Tensor | None) -> None:
        """Move the state past `step`, given its mel (`stream_mel`) and `stream_compute`'s excitation and sum."""
        state.received, state.mel_start, state.source_start, state.f0_frames, state.emitted_frames = step.after
        state.mel, state.source, state.cycles = mel[..., step.mel_keep:], source, cycles
        state.finished = step.finalize
