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
  waveform's zero crossing, a sum that cancels); it is stated relative to the tensor's typical magnitude.

Each bound keeps a margin of 5x or more over the largest difference measured on machines of different CPU
generations and thread counts (the numbers are in each entry), and stays one or more orders of magnitude below the
difference a real error makes: wrong filter bounds, an off-by-one frame, a wrong eps or a wrong batch mask (planted
one at a time; each one still fails its test with these bounds). Comparisons of integers, copies and data movement
stay exact (`EXACT`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float

    def kwargs(self) -> dict[str, float]:
        return {"rtol": self.rtol, "atol": self.atol}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: Tol, msg: str | None = None) -> None:
    """`torch.testing.assert_close` with a named tolerance (shapes must match: no broadcasting hides a bug)."""
    assert actual.shape == expected.shape, (msg, actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, rtol=tol.rtol, atol=tol.atol, msg=msg)


# Integer ids, copies, slices, caches and anything computed by the same kernel on the same input: no rounding of a
# different order happens, so any difference is a bug.
EXACT = Tol(rtol=0.0, atol=0.0)

# Gaussian noise drawn again from upstream's seed (`torch.randn`, values within +-5): the generator's integers are
# the same everywhere, but its Box-Muller transform (log, sqrt, cos) runs in the CPU's vector code at AVX2 and
# AVX-512 and in scalar libm code without them: 1.8e-6 apart measured (ATen's default kernels vs AVX-512). A wrong
# seed or a shifted frame moves it by O(1).
NOISE = Tol(rtol=1e-5, atol=1e-5)

# A few elementwise float32 operations (a cross-fade: two products and a sum on samples within [-1, 1]): each rounds
# to 6e-8 of its result, whatever the CPU's vector width.
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

# One network pass against upstream (the LLM's hidden states and log-probs, the flow's encoder and one estimator
# call): a few layers of matmuls of width <= 1024. Measured 3.8e-6 on log-probs of magnitude 14 (2.7e-7 relative).
NETWORK = Tol(rtol=1e-5, atol=1e-4)

# The flow's full 10-step CFM solve: the estimator's error, carried and amplified through ten Euler steps with
# classifier-free guidance; mel values up to 28. Measured 7.6e-6.
CFM = Tol(rtol=1e-4, atol=5e-4)

# A row of a padded batch against the same stream run alone (the flow's chunks and caches, the LLM's logits and KV):
# the same weights in another summation order (the batch picks another matmul kernel). The flow's mel carries ten
# solver steps: 1.5e-5 on values near 11 measured (1.4e-6 relative). A wrong batch mask moves whole rows by O(1).
BATCH = Tol(rtol=1e-5, atol=1e-5)

# The flow's chunks through the paged runner against the eager flow: paged attention and another batch layout sum
# the same products in another order through ten solver steps (as `BATCH`, with the room a GPU's kernels need).
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
