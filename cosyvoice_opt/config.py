"""Model and engine configuration.

The model dataclasses hold the numbers of the upstream constructors (`cosyvoice2.yaml` and
`CosyVoice-BlankEN/config.json`). `from_upstream` takes the constructor arguments in the nested
shape upstream uses (the yaml, or a parity fixture's JSON), so one parser serves both; `full()` is
the released CosyVoice2-0.5B and `tiny()` a small model of the same structure for tests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Family(str, enum.Enum):
    """A model family: which networks, frontend files and text rules a model folder needs. A folder's family is read
    from its files (`checkpoint.detect_family`), never from its name."""

    COSYVOICE2 = "cosyvoice2"  # CosyVoice2-0.5B
    COSYVOICE3 = "cosyvoice3"  # Fun-CosyVoice3-0.5B


@dataclass(frozen=True)
class Qwen2Config:
    hidden_size: int = 896
    num_layers: int = 24
    num_heads: int = 14
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 4864
    vocab_size: int = 151936
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen2Config:
        """From a Hugging Face Qwen2 `config.json` dict."""
        heads = int(cfg["num_attention_heads"])
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            # transformers >= 5 writes it under rope_parameters
            rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e6)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face style `config.json` dict (what CosyVoice-BlankEN/ ships)."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "attention_dropout": 0.0,
            # <|endoftext|> of the released vocabulary; absent from a small random one
            "bos_token_id": 151643 if self.vocab_size > 151643 else None,
            "eos_token_id": 151643 if self.vocab_size > 151643 else None,
            "torch_dtype": "float32",
        }


@dataclass(frozen=True)
class SamplingConfig:
    """Repetition-aware sampling (RAS) of the speech LLM."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


COSYVOICE2, COSYVOICE3 = "cosyvoice2", "cosyvoice3"
FAMILIES = (COSYVOICE2, COSYVOICE3)
# Where a new voice's speech tokens are made: auto = in PyTorch on a CUDA device when the file is the released
# network, else onnxruntime on the host; torch = in PyTorch on the engine's device; onnx = onnxruntime
SPEECH_TOKENIZER_CHOICES = ("auto", "torch", "onnx")
ENDOFPROMPT = 151646  # `<|endofprompt|>`: CosyVoice3's LLM requires it in prompt_text ++ text


@dataclass(frozen=True)
class LLMConfig:
    """The speech LLM of either family around the same Qwen2: upstream `Qwen2LM` (CosyVoice2) or `CosyVoice3LM`.

    Speech ids past the FSQ codes (`speech_token_size` = 6561) are specials. CosyVoice2: 3 rows (eos 6561, 6562, fill
    6563), sos/task_id in a separate 2-row `llm_embedding`, a head with bias. CosyVoice3: 200 rows (sos 6561, eos
    6562, task_id 6563, fill 6564, ...), sos/task_id are rows of `speech_embedding`, a head without bias; every special
    stops decoding.
    """

    qwen2: Qwen2Config = field(default_factory=Qwen2Config)
    speech_token_size: int = 6561  # FSQ codes
    mix_ratio: tuple[int, int] = (5, 15)  # bistream: text tokens : speech tokens per interleaved block
    fill_token: int | None = None  # bistream "more text needed"; None: upstream's (6563 CosyVoice2, 6564 CosyVoice3)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    family: str = COSYVOICE2
    # Upstream masks only id `speech_token_size` below min_len: CosyVoice2's eos, but CosyVoice3's sos, so there any
    # of 6562..6760 can end an utterance before min_len. True masks every stop id below min_len (a fix, not upstream).
    min_len_masks_all_stops: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; expected one of {FAMILIES}")
        if self.fill_token is None:
            object.__setattr__(self, "fill_token", self.speech_token_size + (3 if self.is_cosyvoice3 else 2))
        if self.fill_token not in self.stop_token_ids:
            raise ValueError(f"fill_token {self.fill_token} must be one of the stop ids {self.stop_token_ids}")

    @property
    def is_cosyvoice3(self) -> bool:
        return self.family == COSYVOICE3

    @property
    def num_speech_rows(self) -> int:
        """Rows of `speech_embedding` and outputs of `llm_decoder`: the codes and the specials."""
        return self.speech_token_size + (200 if self.is_cosyvoice3 else 3)

    @property
    def eos_token(self) -> int:
        return self.speech_token_size + (1 if self.is_cosyvoice3 else 0)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every special id ends decoding (without being emitted)."""
        return tuple(range(self.speech_token_size, self.num_speech_rows))

    @property
    def min_len_masked_ids(self) -> range:
        """The ids masked while fewer than min_len tokens were emitted (`ras_sample`'s ignore_eos)."""
        if self.min_len_masks_all_stops:
            return range(self.speech_token_size, self.num_speech_rows)
        return range(self.speech_token_size, self.speech_token_size + 1)

    @property
    def sos_task_rows(self) -> tuple[int, int] | None:
        """CosyVoice3: the `speech_embedding` rows of sos and task_id; None where `llm_embedding` holds them."""
        return (self.speech_token_size, self.speech_token_size + 2) if self.is_cosyvoice3 else None

    @property
    def head_bias(self) -> bool:
        return not self.is_cosyvoice3

    @property
    def required_text_id(self) -> int | None:
        """A text id that prompt_text ++ text must contain (CosyVoice3: `<|endofprompt|>`), or None."""
        return ENDOFPROMPT if self.is_cosyvoice3 else None

    @classmethod
    def from_upstream(cls, llm: dict[str, Any], qwen2_hf: dict[str, Any], family: str = COSYVOICE2) -> LLMConfig:
        """From `Qwen2LM` / `CosyVoice3LM` (`family`) constructor args (with, where given, the `inference` length
        ratios and the `special_ids`, as a fixture states them) and the Qwen2 HF config. Upstream's yaml has no fill
        id: the class derives it from `speech_token_size`."""
        qwen2 = Qwen2Config.from_hf(qwen2_hf)
        if int(llm.get("llm_input_size", qwen2.hidden_size)) != qwen2.hidden_size:
            raise ValueError("llm_input_size must equal the Qwen2 hidden_size")
        s = llm.get("sampling") or {}
        inference = llm.get("inference") or {}
        fill = llm.get("fill_token", (llm.get("special_ids") or {}).get("fill_token"))
        return cls(
            qwen2=qwen2,
            speech_token_size=int(llm.get("speech_token_size", 6561)),
            mix_ratio=tuple(int(n) for n in llm.get("mix_ratio", (5, 15))),
            fill_token=None if fill is None else int(fill),
            sampling=SamplingConfig(
                top_p=float(s.get("top_p", 0.8)),
                top_k=int(s.get("top_k", 25)),
                win_size=int(s.get("win_size", 10)),
                tau_r=float(s.get("tau_r", 0.1)),
            ),
            min_token_text_ratio=float(inference.get("min_token_text_ratio", 2.0)),
            max_token_text_ratio=float(inference.get("max_token_text_ratio", 20.0)),
            family=family,
        )


@dataclass(frozen=True)
class EncoderConfig:
    """`UpsampleConformerEncoder`: conformer at 25 Hz, x2 up-sampling, conformer at 50 Hz."""

    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4  # hard-coded upstream
    static_chunk_size: int = 25  # tokens; x up_stride at 50 Hz
    up_stride: int = 2
    pre_lookahead_len: int = 3


@dataclass(frozen=True)
class EstimatorConfig:
    """`CausalConditionalDecoder`: the CFM velocity U-Net."""

    in_channels: int = 320
    out_channels: int = 80
    channels: tuple[int, ...] = (256,)
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    static_chunk_size: int = 50  # mel frames


def _cfm_params(decoder: dict[str, Any]) -> dict[str, Any]:
    """The CFM decoder's `cfm_params` (an omegaconf.DictConfig in the yaml: its `content`)."""
    cfm = decoder.get("cfm_params") or {}
    return cfm["content"] if isinstance(cfm, dict) and "content" in cfm else cfm


def _flow_sizes(flow: dict[str, Any]) -> dict[str, int]:
    """What both families' flow constructors take alike: mel and speaker sizes, vocabulary, token-to-mel ratio."""
    return {"input_size": int(flow["input_size"]), "output_size": int(flow["output_size"]),
            "spk_embed_dim": int(flow["spk_embed_dim"]), "vocab_size": int(flow["vocab_size"]),
            "token_mel_ratio": int(flow.get("token_mel_ratio", 2))}


@dataclass(frozen=True)
class FlowConfig:
    input_size: int = 512
    output_size: int = 80  # mel bins
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    n_timesteps: int = 10
    inference_cfg_rate: float = 0.7
    noise_frames: int = 15000  # fixed noise table: max prompt + output = 300 s

    @classmethod
    def from_upstream(
        cls,
        flow: dict[str, Any],
        encoder: dict[str, Any],
        decoder: dict[str, Any],
        estimator: dict[str, Any],
    ) -> FlowConfig:
        """From the constructor args of the flow, its encoder, CFM decoder and estimator."""
        cfm = _cfm_params(decoder)
        pre = int(flow.get("pre_lookahead_len", 3))
        return cls(
            **_flow_sizes(flow),
            pre_lookahead_len=pre,
            encoder=EncoderConfig(
                input_size=int(encoder["input_size"]),
                output_size=int(encoder["output_size"]),
                attention_heads=int(encoder["attention_heads"]),
                linear_units=int(encoder["linear_units"]),
                num_blocks=int(encoder["num_blocks"]),
                static_chunk_size=int(encoder.get("static_chunk_size") or 25),
                pre_lookahead_len=pre,
            ),
            estimator=EstimatorConfig(
                in_channels=int(estimator["in_channels"]),
                out_channels=int(estimator["out_channels"]),
                channels=tuple(int(c) for c in estimator["channels"]),
                attention_head_dim=int(estimator["attention_head_dim"]),
                n_blocks=int(estimator["n_blocks"]),
                num_mid_blocks=int(estimator["num_mid_blocks"]),
                num_heads=int(estimator["num_heads"]),
                static_chunk_size=int(estimator.get("static_chunk_size") or 50),
            ),
            inference_cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)),
        )


@dataclass(frozen=True)
class DiTConfig:
    """CosyVoice3's CFM velocity estimator: upstream `DiT` (AdaLN-Zero blocks, RoPE, causal conv positions)."""

    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64  # attention inner width heads * dim_head may differ from dim
    ff_mult: int = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50  # mel frames
    time_freq_dim: int = 256  # sinusoidal time embedding (fixed upstream)
    conv_pos_kernel: int = 31  # causal conv position embedding (fixed upstream)
    conv_pos_groups: int = 16

    @property
    def inner_dim(self) -> int:
        return self.heads * self.dim_head

    @classmethod
    def from_upstream(cls, estimator: dict[str, Any]) -> DiTConfig:
        """From `DiT` constructor args."""
        return cls(
            dim=int(estimator["dim"]),
            depth=int(estimator["depth"]),
            heads=int(estimator.get("heads", 8)),
            dim_head=int(estimator.get("dim_head", 64)),
            ff_mult=int(estimator.get("ff_mult", 4)),
            mel_dim=int(estimator.get("mel_dim", 80)),
            mu_dim=int(estimator.get("mu_dim") or estimator.get("mel_dim", 80)),
            spk_dim=int(estimator.get("spk_dim", 80)),
            out_channels=int(estimator.get("out_channels") or estimator.get("mel_dim", 80)),
            static_chunk_size=int(estimator.get("static_chunk_size") or 50),
        )


@dataclass(frozen=True)
class FlowDiTConfig:
    """CosyVoice3's flow, upstream `CausalMaskedDiffWithDiT`: an 80-d token embedding, a pre-lookahead layer, x2
    repetition to the mel rate (no conformer encoder) and the DiT inside the same CFM as CosyVoice2's."""

    input_size: int = 80  # token embedding width = mel bins
    output_size: int = 80  # mel bins
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    estimator: DiTConfig = field(default_factory=DiTConfig)
    n_timesteps: int = 10
    inference_cfg_rate: float = 0.7
    noise_frames: int = 15000  # fixed noise table: max prompt + output = 300 s

    @property
    def chunk_tokens(self) -> int:
        """The estimator's streaming chunk in tokens (25)."""
        return self.estimator.static_chunk_size // self.token_mel_ratio

    @classmethod
    def from_upstream(
        cls,
        flow: dict[str, Any],
        pre_lookahead_layer: dict[str, Any],
        decoder: dict[str, Any],
        estimator: dict[str, Any],
        n_timesteps: int = 10,
    ) -> FlowDiTConfig:
        """From the constructor args of the flow, its pre-lookahead layer, CFM decoder and DiT estimator."""
        cfm = _cfm_params(decoder)
        pre = int(pre_lookahead_layer.get("pre_lookahead_len", flow.get("pre_lookahead_len", 3)))
        if int(pre_lookahead_layer.get("in_channels", flow["input_size"])) != int(flow["input_size"]):
            raise ValueError("the pre-lookahead layer's in_channels must equal the flow's input_size")
        return cls(
            **_flow_sizes(flow),
            pre_lookahead_len=pre,
            pre_lookahead_channels=int(pre_lookahead_layer["channels"]),
            estimator=DiTConfig.from_upstream(estimator),
            n_timesteps=int(n_timesteps),
            inference_cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)),
        )


@dataclass(frozen=True)
class HiFTConfig:
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5),) * 3
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5),) * 3
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_cond_channels: int = 512

    @property
    def upsample_scale(self) -> int:
        """Waveform samples per mel frame (480 at 24 kHz)."""
        scale = self.istft_hop
        for r in self.upsample_rates:
            scale *= r
        return scale

    @classmethod
    def from_upstream(cls, hift: dict[str, Any], f0_predictor: dict[str, Any]) -> HiFTConfig:
        """From `HiFTGenerator` and `ConvRNNF0Predictor` constructor args."""
        istft = hift.get("istft_params") or {}
        return cls(
            in_channels=int(hift["in_channels"]),
            base_channels=int(hift["base_channels"]),
            nb_harmonics=int(hift["nb_harmonics"]),
            sampling_rate=int(hift["sampling_rate"]),
            nsf_alpha=float(hift["nsf_alpha"]),
            nsf_sigma=float(hift["nsf_sigma"]),
            nsf_voiced_threshold=float(hift["nsf_voiced_threshold"]),
            upsample_rates=tuple(int(x) for x in hift["upsample_rates"]),
            upsample_kernel_sizes=tuple(int(x) for x in hift["upsample_kernel_sizes"]),
            istft_n_fft=int(istft.get("n_fft", 16)),
            istft_hop=int(istft.get("hop_len", 4)),
            resblock_kernel_sizes=tuple(int(x) for x in hift["resblock_kernel_sizes"]),
            resblock_dilation_sizes=tuple(tuple(int(d) for d in ds) for ds in hift["resblock_dilation_sizes"]),
            source_resblock_kernel_sizes=tuple(int(x) for x in hift["source_resblock_kernel_sizes"]),
            source_resblock_dilation_sizes=tuple(
                tuple(int(d) for d in ds) for ds in hift["source_resblock_dilation_sizes"]
            ),
            lrelu_slope=float(hift.get("lrelu_slope", 0.1)),
            audio_limit=float(hift.get("audio_limit", 0.99)),
            f0_cond_channels=int(f0_predictor["cond_channels"]),
        )


@dataclass(frozen=True)
class CausalHiFTConfig(HiFTConfig):
    """CosyVoice3's `CausalHiFTGenerator` + `CausalConvRNNF0Predictor`: the HiFT numbers plus conv_pre's look-ahead,
    the fixed source noise's recipe, and a switch for each upstream quirk (on by default: upstream's numbers)."""

    conv_pre_look_right: int = 4  # mel frames
    noise_seed: int | None = None  # RNG seed right before construction (the fixtures'); None: upstream's loader's
    noise_samples: int = 7_200_000  # rows of fixed noise upstream draws once: 300 s at 24 kHz
    staircase_source: bool = True  # each harmonic held constant over a mel frame (off: integrated per sample)
    fixed_noise: bool = True  # uniform noise drawn once and reused by every call (off: Gaussian, drawn per call)
    f0_float64: bool = True  # the f0 predictor runs in float64 (off: in the parameters' dtype)

    @classmethod
    def from_upstream(
        cls, hift: dict[str, Any], f0_predictor: dict[str, Any], fixed_noise: dict[str, Any] | None = None,
    ) -> CausalHiFTConfig:
        """From `CausalHiFTGenerator` and `CausalConvRNNF0Predictor` constructor args, and the fixed-noise recipe
        (`fixed_noise.noise_seed`) where given."""
        base = HiFTConfig.from_upstream(hift, f0_predictor)
        fields = {name: getattr(base, name) for name in HiFTConfig.__dataclass_fields__}
        noise = fixed_noise or {}
        return cls(
            **fields,
            conv_pre_look_right=int(hift.get("conv_pre_look_right", 4)),
            noise_seed=int(noise["noise_seed"]) if "noise_seed" in noise else None,
        )


@dataclass(frozen=True)
class FeatureConfig:
    """The 24 kHz prompt mel (`feat_extractor` in the yaml, matcha's mel_spectrogram). `fmax` None is the Nyquist
    rate (CosyVoice3's yaml has `fmax: null`; CosyVoice2's 8000)."""

    n_fft: int = 1920
    num_mels: int = 80
    sampling_rate: int = 24000
    hop_size: int = 480
    win_size: int = 1920
    fmin: float = 0.0
    fmax: float | None = 8000.0

    @classmethod
    def for_family(cls, family: Family) -> FeatureConfig:
        """The released settings of a family: they differ only in `fmax`."""
        return cls(fmax=None) if Family(family) == Family.COSYVOICE3 else cls()


@dataclass(frozen=True)
class ModelConfig:
    """A model's hyperparameters. The family follows from the networks: CosyVoice2's `FlowConfig` / `HiFTConfig`,
    or CosyVoice3's `FlowDiTConfig` / `CausalHiFTConfig` with an LLM of family `cosyvoice3`."""

    llm: LLMConfig = field(default_factory=LLMConfig)
    flow: FlowConfig | FlowDiTConfig = field(default_factory=FlowConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)
    feat: FeatureConfig = field(default_factory=FeatureConfig)
    sample_rate: int = 24000
    token_frame_rate: int = 25

    def __post_init__(self) -> None:
        v3 = self.llm.is_cosyvoice3
        parts = {"flow": (self.flow, FlowDiTConfig), "hift": (self.hift, CausalHiFTConfig)}
        for name, (part, v3_class) in parts.items():
            if isinstance(part, v3_class) != v3:
                raise ValueError(f"a {self.llm.family} model cannot have a {type(part).__name__} {name}")

    @property
    def family(self) -> Family:
        return Family(self.llm.family)

    @classmethod
    def full(cls, family: Family | str = Family.COSYVOICE2) -> ModelConfig:
        """The released CosyVoice2-0.5B or Fun-CosyVoice3-0.5B."""
        if Family(family) == Family.COSYVOICE3:
            return cls(llm=LLMConfig(family=COSYVOICE3), flow=FlowDiTConfig(), hift=CausalHiFTConfig(),
                       feat=FeatureConfig.for_family(Family.COSYVOICE3))
        return cls()

    @classmethod
    def tiny(cls, family: Family | str = Family.COSYVOICE2) -> ModelConfig:
        """Same structure and structural constants, small widths: for tests on CPU. CosyVoice3's keeps the released
        text vocabulary: its LLM finds `<|endofprompt|>` by the released id (151646)."""
        v3 = Family(family) == Family.COSYVOICE3
        qwen2 = Qwen2Config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=128, vocab_size=151936 if v3 else 2048)
        if v3:
            return cls(
                llm=LLMConfig(qwen2=qwen2, family=COSYVOICE3),
                flow=FlowDiTConfig(pre_lookahead_channels=64,
                                   estimator=DiTConfig(dim=64, depth=2, heads=4, dim_head=16)),
                hift=CausalHiFTConfig(base_channels=32, f0_cond_channels=32),
                feat=FeatureConfig.for_family(Family.COSYVOICE3),
            )
        return cls(
            llm=LLMConfig(qwen2=qwen2),
            flow=FlowConfig(
                input_size=64,
                encoder=EncoderConfig(input_size=64, output_size=64, attention_heads=4, linear_units=128,
                                      num_blocks=2),
                estimator=EstimatorConfig(channels=(64,), attention_head_dim=16, n_blocks=1, num_mid_blocks=2,
                                          num_heads=2),
            ),
            hift=HiFTConfig(base_channels=32, f0_cond_channels=32),
        )
