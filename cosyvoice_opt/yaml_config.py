"""Read upstream's HyperPyYAML `cosyvoice2.yaml` / `cosyvoice3.yaml` as plain data, without executing anything.

Upstream builds objects from tags such as `!new:cosyvoice.llm.llm.Qwen2LM` and `!apply:torch.manual_seed`;
we only need the numbers. Every tagged node becomes plain data (a tagged mapping its dict, a tagged
sequence its list, a tagged scalar its string), `!ref <name>` is resolved against the top-level keys,
and `!ref <a> * <b>` style arithmetic is evaluated on numbers only (no `eval`).
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

import yaml

from .config import (
    CausalHiFTConfig,
    Family,
    FeatureConfig,
    FlowConfig,
    FlowDiTConfig,
    HiFTConfig,
    LLMConfig,
    ModelConfig,
)


class _Ref(str):
    """The text of a `!ref` node, resolved after the whole document is read."""


class _TagIgnoringLoader(yaml.SafeLoader):
    pass


def _construct_tagged(loader: yaml.SafeLoader, tag_suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_TagIgnoringLoader.add_constructor("!ref", lambda loader, node: _Ref(loader.construct_scalar(node)))
_TagIgnoringLoader.add_multi_constructor("!", _construct_tagged)

_REF = re.compile(r"<([^<>]+)>")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv}


def _arith(expr: str) -> Any:
    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported expression in !ref: {expr!r}")

    return ev(ast.parse(expr, mode="eval").body)


def _resolve(value: Any, top: dict[str, Any], depth: int = 0) -> Any:
    if depth > 20:
        raise ValueError("!ref nesting too deep (a cycle?)")
    if isinstance(value, _Ref):
        names = _REF.findall(value)
        if len(names) == 1 and value.strip() == f"<{names[0]}>":
            return _resolve(top[names[0]], top, depth + 1)
        text = _REF.sub(lambda m: repr(_resolve(top[m.group(1)], top, depth + 1)), value)
        return _arith(text)
    if isinstance(value, dict):
        return {k: _resolve(v, top, depth) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top, depth) for v in value]
    return value


def read_hyperpyyaml(text: str) -> dict[str, Any]:
    """Parse HyperPyYAML text into plain dicts/lists/scalars with `!ref`s resolved."""
    raw = yaml.load(text, Loader=_TagIgnoringLoader)  # noqa: S506 - a SafeLoader subclass
    if not isinstance(raw, dict):
        raise ValueError("the top level is not a mapping")
    return {k: _resolve(v, raw) for k, v in raw.items() if not str(k).startswith("__")}


def _fmax(value: Any) -> float | None:
    """`fmax: null` is the Nyquist rate (CosyVoice3), not a missing setting."""
    return None if value is None else float(value)


def model_config_from_yaml(doc: dict[str, Any], qwen2_hf: dict[str, Any],
                           family: Family = Family.COSYVOICE2) -> ModelConfig:
    """Our `ModelConfig` from a parsed `cosyvoice2.yaml` or `cosyvoice3.yaml` (`family`, which
    `checkpoint.detect_family` read from the yaml's classes) and `CosyVoice-BlankEN/config.json`."""
    flow, hift = doc["flow"], doc["hift"]
    feat = doc.get("feat_extractor") or {}
    defaults = FeatureConfig.for_family(family)
    if Family(family) == Family.COSYVOICE3:
        flow_cfg = FlowDiTConfig.from_upstream(flow, flow["pre_lookahead_layer"], flow["decoder"],
                                               flow["decoder"]["estimator"])
        hift_cfg = CausalHiFTConfig.from_upstream(hift, hift["f0_predictor"])
    else:
        flow_cfg = FlowConfig.from_upstream(flow, flow["encoder"], flow["decoder"], flow["decoder"]["estimator"])
        hift_cfg = HiFTConfig.from_upstream(hift, hift["f0_predictor"])
    return ModelConfig(
        llm=LLMConfig.from_upstream(doc["llm"], qwen2_hf, Family(family).value),
        flow=flow_cfg,
        hift=hift_cfg,
        feat=FeatureConfig(
            n_fft=int(feat.get("n_fft", defaults.n_fft)),
            num_mels=int(feat.get("num_mels", defaults.num_mels)),
            sampling_rate=int(feat.get("sampling_rate", defaults.sampling_rate)),
            hop_size=int(feat.get("hop_size", defaults.hop_size)),
            win_size=int(feat.get("win_size", defaults.win_size)),
            fmin=float(feat.get("fmin", defaults.fmin)),
            fmax=_fmax(feat.get("fmax", defaults.fmax)),
        ),
        sample_rate=int(doc.get("sample_rate", 24000)),
        token_frame_rate=int(doc.get("token_frame_rate", 25)),
    )


def _render_head(cfg: ModelConfig, layout: str, llm_class: str, extra: str) -> str:
    """What both families' yaml files open with: the shared constants (and `extra` ones), then the speech LLM."""
    q, f = cfg.llm, cfg.flow
    return f"""# Written by cosyvoice-opt (random weights): upstream's {layout} layout, model section only.
sample_rate: {cfg.sample_rate}
llm_input_size: {q.qwen2.hidden_size}
llm_output_size: {q.qwen2.hidden_size}
spk_embed_dim: {f.spk_embed_dim}
qwen_pretrain_path: ''
token_frame_rate: {cfg.token_frame_rate}
token_mel_ratio: {f.token_mel_ratio}
{extra}
llm: !new:cosyvoice.llm.llm.{llm_class}
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {q.speech_token_size}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [{q.mix_ratio[0]}, {q.mix_ratio[1]}]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: {q.sampling.top_p}
        top_k: {q.sampling.top_k}
        win_size: {q.sampling.win_size}
        tau_r: {q.sampling.tau_r}
"""


def render_yaml(cfg: ModelConfig) -> str:
    """A `cosyvoice2.yaml` or `cosyvoice3.yaml` (by `cfg.family`) for `cfg` in upstream's layout and tags (for
    random model folders)."""
    if cfg.family == Family.COSYVOICE3:
        return _render_cosyvoice3(cfg)
    f, e, s, h = cfg.flow, cfg.flow.encoder, cfg.flow.estimator, cfg.hift
    return f"""{_render_head(cfg, "cosyvoice2.yaml", "Qwen2LM", "")}
{_render_flow_head(f, "CausalMaskedDiffWithXvec")}
    pre_lookahead_len: {f.pre_lookahead_len}
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: {e.output_size}
        attention_heads: {e.attention_heads}
        linear_units: {e.linear_units}
        num_blocks: {e.num_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {e.input_size}
        use_cnn_module: False
        macaron_style: False
        use_dynamic_chunk: True
{_render_cfm(f)}
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: {s.in_channels}
            out_channels: {s.out_channels}
            channels: [{', '.join(map(str, s.channels))}]
            dropout: 0.0
            attention_head_dim: {s.attention_head_dim}
            n_blocks: {s.n_blocks}
            num_mid_blocks: {s.num_mid_blocks}
            num_heads: {s.num_heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <token_frame_rate> * <token_mel_ratio>
            num_decoding_left_chunks: 2

{_render_hift(h, "HiFTGenerator", "ConvRNNF0Predictor")}

{_render_feat(cfg)}
"""


def _render_cosyvoice3(cfg: ModelConfig) -> str:
    f, d, h = cfg.flow, cfg.flow.estimator, cfg.hift
    chunks = f"chunk_size: {f.chunk_tokens}\nnum_decoding_left_chunks: -1\n"
    return f"""{_render_head(cfg, "cosyvoice3.yaml", "CosyVoice3LM", chunks)}
{_render_flow_head(f, "CausalMaskedDiffWithDiT")}
    pre_lookahead_len: {f.pre_lookahead_len}
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: {f.input_size}
        channels: {f.pre_lookahead_channels}
        pre_lookahead_len: {f.pre_lookahead_len}
{_render_cfm(f)}
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {d.dim}
            depth: {d.depth}
            heads: {d.heads}
            dim_head: {d.dim_head}
            ff_mult: {d.ff_mult}
            mel_dim: {d.mel_dim}
            mu_dim: {d.mu_dim}
            spk_dim: {d.spk_dim}
            out_channels: {d.out_channels}
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

{_render_hift(h, "CausalHiFTGenerator", "CausalConvRNNF0Predictor", conv_pre_look_right=h.conv_pre_look_right)}

{_render_feat(cfg)}
"""


def _render_flow_head(f: FlowConfig | FlowDiTConfig, flow_class: str) -> str:
    """The flow's opening entries, the same in both families' yaml files."""
    return f"""flow: !new:cosyvoice.flow.flow.{flow_class}
    input_size: {f.input_size}
    output_size: {f.output_size}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {f.vocab_size}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>"""


def _render_cfm(f: FlowConfig | FlowDiTConfig) -> str:
    """The flow's CFM solver (its estimator follows), the same in both families' yaml files."""
    return f"""    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: {f.output_size}
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: {f.inference_cfg_rate}
                reg_loss_type: 'l1'"""


def _render_hift(h: HiFTConfig, hift_class: str, f0_class: str, **extra: int) -> str:
    dil = ", ".join(f"[{', '.join(map(str, d))}]" for d in h.resblock_dilation_sizes)
    sdil = ", ".join(f"[{', '.join(map(str, d))}]" for d in h.source_resblock_dilation_sizes)
    more = "".join(f"\n    {k}: {v}" for k, v in extra.items())
    return f"""hift: !new:cosyvoice.hifigan.generator.{hift_class}
    in_channels: {h.in_channels}
    base_channels: {h.base_channels}
    nb_harmonics: {h.nb_harmonics}
    sampling_rate: !ref <sample_rate>
    nsf_alpha: {h.nsf_alpha}
    nsf_sigma: {h.nsf_sigma}
    nsf_voiced_threshold: {h.nsf_voiced_threshold}
    upsample_rates: [{', '.join(map(str, h.upsample_rates))}]
    upsample_kernel_sizes: [{', '.join(map(str, h.upsample_kernel_sizes))}]
    istft_params:
        n_fft: {h.istft_n_fft}
        hop_len: {h.istft_hop}
    resblock_kernel_sizes: [{', '.join(map(str, h.resblock_kernel_sizes))}]
    resblock_dilation_sizes: [{dil}]
    source_resblock_kernel_sizes: [{', '.join(map(str, h.source_resblock_kernel_sizes))}]
    source_resblock_dilation_sizes: [{sdil}]
    lrelu_slope: {h.lrelu_slope}
    audio_limit: {h.audio_limit}{more}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.{f0_class}
        num_class: 1
        in_channels: {h.in_channels}
        cond_channels: {h.f0_cond_channels}"""


def _render_feat(cfg: ModelConfig) -> str:
    m = cfg.feat
    return f"""feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: {m.n_fft}
    num_mels: {m.num_mels}
    sampling_rate: !ref <sample_rate>
    hop_size: {m.hop_size}
    win_size: {m.win_size}
    fmin: {m.fmin:g}
    fmax: {"null" if m.fmax is None else f"{m.fmax:g}"}
    center: False"""
