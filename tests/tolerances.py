"""Every numeric tolerance of the test suite, and why it is what it is.

Float32 arithmetic rounds each operation to 2**-24 (6e-8) of its result, and a sum's rounding depends on its order.
That order is not ours to fix: it changes with the CPU's vector width (SSE, AVX2 and AVX-512 kernels of MKL, oneDNN
and ATen), the thread count (how a reduction is split), the shape of a batch (the algorithm a library picks for it)
and the library version. A parity test compares our float32 result with upstream's, computed on another machine; a
batch-vs-alone test compares two orders of the same sums on this one. Neither can be bit-exact anywhere
`./run.sh test` runs.

So a bound is `|actual - expected| <= atol + rtol * |expected|` (`torch.testing.assert_close`) with both parts
justified:

* `rtol` scales the bound with the values: rounding is relative to the magnitude of what is computed, and a tensor
  of logits near 14 carries 14 times the absolute error of one near 1. It grows with the operation's depth: each
  layer carries and amplifies the rounding of the layers before it.
* `atol` covers values near zero whose error comes from larger intermediates (a log of a small spectral bin, a
  waveform's zero crossing, a sum that cancels); it is stated relative to the tensor's typical magnitude. Where a
  set's magnitude is not known in advance (a waveform's peak, an f0 track), `of_peak` makes `atol` a fraction of the
  expected tensor's largest magnitude, so the bound follows the set.

Each bound keeps a margin of 5x or more over the largest difference measured on machines of different CPU
generations and thread counts (the numbers are in each entry), and stays well below the difference a real error
makes: wrong filter bounds, an off-by-one frame, a wrong eps or a wrong batch mask (planted one at a time; each one
still fails its test with these bounds). Where a real error sits closer than that, the entry says so and keeps the
smaller margin: a bound must not let a planted error pass. Comparisons of integers, copies and data movement
stay exact (`EXACT`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float
    of_peak: bool = False  # atol is a fraction of the expected tensor's largest magnitude

    def kwargs(self, expected: torch.Tensor | None = None) -> dict[str, float]:
        """rtol and atol for `torch.testing.assert_close` / `torch.allclose` (`of_peak` needs the expected tensor)."""
        if not self.of_peak:
            return {"rtol": self.rtol, "atol": self.atol}
        assert expected is not None, "a peak-relative tolerance needs the expected tensor"
        peak = float(expected.abs().max()) if expected.numel() else 0.0
        return {"rtol": self.rtol, "atol": self.atol * peak}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: Tol, msg: str | None = None) -> None:
    """`torch.testing.assert_close` with a named tolerance (shapes must match: no broadcasting hides a bug)."""
    assert actual.shape == expected.shape, (msg, actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, **tol.kwargs(expected), msg=msg)


# Integer ids, copies, slices, caches and anything computed by the same kernel on the same input: no rounding of a
# different order happens, so any difference is a bug.
EXACT = Tol(rtol=0.0, atol=0.0)

# Gaussian noise drawn again from upstream's seed (`torch.randn`, values within +-5): the generator's integers are
# the same everywhere, but its Box-Muller transform (log, sqrt, cos) runs in the CPU's vector code at AVX2 and
# AVX-512 and in scalar libm code without them: 1.8e-6 apart measured (ATen's default kernels vs AVX-512). A wrong
# seed or a shifted frame moves it by O(1).
NOISE = Tol(rtol=1e-5, atol=1e-5)

# A few elementwise float32 operations (a cross-fade: two products and a sum on samples within [-1, 1]; the DiT's RoPE
# frequencies, a pow and a division; the CFM's time grid, 1 - cos; a float64 f0 cast to float32): each rounds to 6e-8
# of its result, but vectorised pow and cos (SLEEF at AVX2 and AVX-512, within 1 ulp) and libm's scalar code may
# round the last bit apart. Measured 0 (ATen's default, AVX2 and AVX-512 kernels). f0 computed in float32 instead of
# float64 moves its float32 cast by 6.6e-7 relative (6x this bound).
ELEMENTWISE = Tol(rtol=1e-6, atol=1e-6)

# Resampled audio (a windowed-sinc filter: dot products of a few hundred taps on samples in [-1, 1]). A dot product
# of n terms rounds to about sqrt(n) * 6e-8 of full scale (1e-6 for n = 300); measured 0 on AVX2 and AVX-512.
RESAMPLE = Tol(rtol=1e-5, atol=2e-6)

# Whisper's log-mel ((log10(power) + 4) / 4, values in [max - 2, max]). The log turns the FFT's rounding, which is
# relative to the frame's loudest bin, into an absolute error that is largest on the quiet bins: 3.8e-5 on values up
# to 1.38 on one AVX-512 CPU (0 on another). Planted errors: mel filters up to 7900 Hz instead of 8 kHz (0.67), an
# off-by-one STFT frame (0.97), a dynamic range of 7.9 instead of 8 (2.5e-2), a symmetric Hann window (6.8e-2).
LOG_MEL = Tol(rtol=1e-4, atol=2e-4)

# The flow's 24 kHz prompt mel (natural log of the magnitude, values in [-11.5, 9]): the natural log of a magnitude
# has 4.6x the error the log-mel above has for the same spectrum (ln vs log10 / 4, halved by the square root).
# Measured 0 here (AVX2 and AVX-512 kernels); the bound allows the log-mel's worst case, scaled by that 4.6x. A
# planted sqrt eps of 1e-6 instead of 1e-9 moves it by 0.15, mel filters 100 Hz short by 2.1.
PROMPT_MEL = Tol(rtol=1e-4, atol=1e-3)

# Kaldi fbank of CAM++, mean-normalised (values within +-12): its log of small bins turns the FFT's rounding into
# up to 1.1e-4 (measured); the mean error (tests/test_frontend_audio.py) is the sharper check, this bound catches a
# single broken bin. Absolute only: at 1e-3 of the largest values no float32 rounding comes near it.
FBANK = Tol(rtol=0.0, atol=1e-2)

# One network pass against upstream (the LLM's hidden states and log-probs, CosyVoice3's LLM included, the flow's
# encoder and one estimator call): a few layers of matmuls of width <= 1024. Measured 3.8e-6 on log-probs of
# magnitude 14 (2.7e-7 relative); CosyVoice3's LLM 2.6e-5 on log-probs up to 35 (KV-cache decode), 1.4e-6 on hidden
# states up to 2.7, across ATen's default, AVX2 and AVX-512 kernels and 1-2 threads. The RMSNorm eps 1e-5 instead of
# 1e-6 (one norm per layer) moves them by 10x (hidden) and 46x (log-probs) this bound.
NETWORK = Tol(rtol=1e-5, atol=1e-4)

# One network pass whose output magnitude the set decides, bounded relative to the expected tensor's peak:
# CosyVoice3's DiT call and its blocks (one call of depth-many blocks, outputs up to 8.6 at tiny size), and the LLM's
# nucleus probabilities (a softmax of `NETWORK`'s log-probs, at most 1). Measured 6.2e-7 of the peak (DiT output,
# 5.3e-6 absolute) and 1.5e-7 on probabilities, across ATen's default, AVX2 and AVX-512 kernels and 1-2 threads. The
# DiT's LayerNorm eps 1e-5 instead of 1e-6 moves its output by 2.4e-5 of the peak; RoPE on all channels of q and k
# instead of the first head's, by 4e-2.
NETWORK_PEAK = Tol(rtol=1e-5, atol=1e-5, of_peak=True)

# The speech tokenizer's FSQ values (tanh-bounded, |v| < 1) in PyTorch against onnxruntime on the same random file of
# the released network (two convs, two 256-wide blocks): two runtimes' kernels sum in other orders. Measured 1.1e-6.
# Rotary positions left out move them by up to 0.25; the attention LayerNorm's eps 1e-5 instead of 1e-6, by 6e-5 to
# 2.5e-4.
SPEECH_TOKENIZER = Tol(rtol=1e-5, atol=2e-5)

# The flow's full 10-step CFM solve: the estimator's error, carried and amplified through ten Euler steps with
# classifier-free guidance; mel values up to 28. Measured 7.6e-6.
CFM = Tol(rtol=1e-4, atol=5e-4)

# CosyVoice3's 10-step CFM solve over the DiT (`NETWORK_PEAK`'s error carried through ten steps), relative to the
# mel's peak: upstream's calls, our streaming chunks, and the same mel inside CosyVoice3Model.tts. Measured 8.5e-7 of
# the peak (4.8e-6 absolute on values up to 8.6) across ATen's default, AVX2 and AVX-512 kernels and 1-2 threads;
# RoPE on all channels moves the mel by 5e-2 of the peak.
CFM_PEAK = Tol(rtol=3e-5, atol=3e-5, of_peak=True)

# A row of a padded batch against the same stream run alone (the flow's chunks and caches, the LLM's logits and KV):
# the same weights in another summation order (the batch picks another matmul kernel). The flow's mel carries ten
# solver steps: 1.5e-5 on values near 11 measured (1.4e-6 relative). CosyVoice3's DiT: a padded row vs alone 1.7e-6
# on values up to 4.7, batched streams 1.4e-6 on values up to 5.3, chunk-by-chunk K/V vs one block-causal run 1.9e-6
# on values up to 5.9. A wrong batch mask moves whole rows by O(1).
BATCH = Tol(rtol=1e-5, atol=1e-5)

# The flow's chunks through the paged runner against the eager flow: paged attention and another batch layout sum
# the same products in another order through ten solver steps (as `BATCH`, with the room a GPU's kernels need).
# Measured on the CPU 3.1e-6 on values up to 6.1 (CosyVoice2's U-Net), 1.4e-6 on values up to 5.8 (CosyVoice3's
# DiT). Wrong RoPE positions of the paged DiT (a row's history ignored, CFG rows swapped) or a conv history off by one
# frame move whole chunks by O(1).
PAGED = Tol(rtol=1e-5, atol=1e-4)

# HiFT's waveform from a given mel and excitation (samples within [-0.2, 0.2] at tiny size), and the STFT of its
# excitation (values up to 3): a deep conv stack and an inverse STFT. Measured 7.2e-7.
HIFT = Tol(rtol=1e-5, atol=1e-5)

# HiFT's f0 predictor (Hz, values up to a few hundred): a conv stack ending in a large linear output. Measured 0
# against upstream; a batch runs its convs with another algorithm than one row (4e-5 apart measured), hence the
# larger relative part for batch rows.
F0 = Tol(rtol=1e-5, atol=1e-4)
F0_BATCH = Tol(rtol=1e-4, atol=1e-4)

# HiFT's harmonic excitation: a sine whose phase is a cumulative sum over every sample, where float32 rounding grows
# with the length (1e-3 of amplitude 0.4 after a few seconds).
PHASE = Tol(rtol=1e-3, atol=1e-3)

# Audio at the end of the whole pipeline (flow chunks + HiFT with the phase above + cross-fades), as float in
# [-1, 1]: the excitation's phase error integrates through HiFT (3.8e-4 measured).
E2E = Tol(rtol=1e-3, atol=2e-3)

# Values that upstream computes in bfloat16 (the engine's serving dtype) against upstream's float32: bf16 keeps 8 bits
# (4e-3 relative rounding per operation) through a DiT call. Measured 9.6e-3 of the output's peak (ATen's default,
# AVX2 and AVX-512 kernels), a 3x margin: a bf16 call carries its rounding through every block. RoPE on all channels
# moves the float32 call by 4e-2 of the peak (`NETWORK_PEAK`); the test's float32 angle checks are exact.
BF16 = Tol(rtol=3e-2, atol=3e-2, of_peak=True)

# CausalHiFT's f0 predictor in float64 (as upstream runs it): float64 rounds to 1e-16, so a conv stack stays within
# 1e-15 of the peak (measured 1.2e-15 on f0 up to 208 Hz, every kernel). Any float32 step moves it by 1e-7 of the
# peak or more (the predictor run in float32: 7.5e-7 of the peak), 100x this bound.
F0_FLOAT64 = Tol(rtol=1e-9, atol=1e-9, of_peak=True)

# CausalHiFT's f0 predictor run in float32 against upstream's float64 (the `f0_float64=False` switch): float32 convs,
# 1.6e-4 Hz measured on f0 up to 208 Hz (7.5e-7 relative).
F0_FLOAT32 = Tol(rtol=1e-4, atol=1e-4)

# CausalHiFT's excitation: tanh of a sum of staircase harmonics and fixed noise, in (-1, 1), so an absolute bound is
# relative to its full scale. Measured 6e-8 (1 ulp), every kernel.
CAUSAL_SOURCE = Tol(rtol=1e-5, atol=1e-6)

# A sine of a float32 phase summed over a few thousand samples (a HiFT excitation of a fraction of a second): the
# phase's rounding grows with the sample count, 7.9e-7 measured at 2880 samples on amplitude 0.1 (8e-6 of the peak).
# A shift by one sample moves the sine by 8.4e-3 (8% of the peak).
SINE = Tol(rtol=1e-5, atol=1e-4, of_peak=True)

# CausalHiFT's waveform from a given mel (and excitation): a causal conv stack and an inverse STFT, samples at a peak
# of about 0.1 at tiny size, so the bound follows the peak. Upstream's f0 runs in float64; measured 1.3e-5 of the peak
# against upstream across ATen's default, AVX2 and AVX-512 kernels and 1-2 threads. The margin is 4x, as a real error
# sits just above: f0 computed in float32 instead of float64 moves the waveform by 1.3e-4 to 1.8e-3 of the peak,
# depending on the call (2.4x to 36x this bound; every waveform test fails on it).
CAUSAL_WAVE = Tol(rtol=1e-5, atol=5e-5, of_peak=True)

# CosyVoice3Model.tts audio from our flow's mel (flow + CausalHiFT, streaming or not): the tiny sets' f0 predictor
# turns the flow's float32 rounding (1e-6 of the mel, `CFM_PEAK`) into 1e-4 Hz of f0, which the excitation's phase
# accumulates over the utterance: 5.5e-3 of the peak measured (4.4e-3 to 5.5e-3 across ATen's default, AVX2 and
# AVX-512 kernels and 1-2 threads). The margin is under 4x because a small real error sits just above: the harmonic
# excitation 1% too loud moves the speed-changed audio by 2.5e-2 of the peak (5% too loud: 0.13). HiFT on upstream's
# own mel is held to `CAUSAL_WAVE`; this bound catches a wrong chunk, offset, silent-token rule, speed change or
# excitation.
CV3_AUDIO = Tol(rtol=0.0, atol=2e-2, of_peak=True)


# Triton's kernels run by its CPU interpreter (numpy, float32) against the PyTorch composition they fuse
# (tests/test_fused.py). The inputs are drawn with magnitudes up to 4 and the reported differences are maxima of
# |kernel - composition| over outputs of magnitude up to 3.1 (measured), so a bound of 1e-5 is about 3e-6 of the
# values: the differences measured are at most 7.2e-7 (the sums' order differs), 14x under it.
KERNEL_INTERPRETER_MAX_DIFF = 1e-5

# A captured HiFT graph against the same eager call on the GPU (tests/test_hift_graphs.py): cuDNN may pick another
# convolution algorithm for a capture, 1.1e-5 apart on the H200; the output is a waveform within [-1, 1], where 5e-5
# is under two int16 steps.
GRAPH_VS_EAGER_WAVE = Tol(rtol=0.0, atol=5e-5)

# A captured CausalHiFT step against the same eager step on the GPU (tests/test_causal_hift_graphs.py): besides the
# capture's convolution algorithms, the f0 predictor runs in float64 and the excitation's phase sums f0 over the
# utterance, so a capture's rounding grows along it: 9.6e-5 apart on the H200 (163 of 48000 samples past 5e-5). The
# bound is 5x that, 16 int16 steps; a replay of a stale or another row's input is off by the waveform's own size.
# Parity to upstream is held on the CPU, to `CAUSAL_WAVE`.
CAUSAL_GRAPH_VS_EAGER_WAVE = Tol(rtol=0.0, atol=5e-4)
