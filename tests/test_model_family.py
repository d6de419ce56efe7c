"""Model families: what a folder's files say it is, mixed folders refused by name, the family's prompt mel, and saved
voices that record the speech tokenizer their tokens came from."""

from __future__ import annotations

import math

import pytest
import torch

from cosyvoice_opt.config import Family, FeatureConfig, ModelConfig
from cosyvoice_opt.frontend.features import prompt_mel
from cosyvoice_opt.yaml_config import model_config_from_yaml, read_hyperpyyaml, render_yaml

# ---------------------------------------------------------------------------------------------------- prompt mel


def test_feature_config_per_family():
    assert FeatureConfig.for_family(Family.COSYVOICE2) == FeatureConfig() and FeatureConfig().fmax == 8000
    assert FeatureConfig.for_family(Family.COSYVOICE3) == FeatureConfig(fmax=None)


@pytest.mark.parametrize(("line", "fmax"), [("    fmax: null\n", None), ("    fmax: 8000\n", 8000.0), ("", 8000.0)],
                         ids=["null", "8000", "absent"])
def test_yaml_fmax_null_is_nyquist_not_the_default(line, fmax):
    text = render_yaml(ModelConfig.tiny())
    text = "\n".join(s for s in text.splitlines() if not s.strip().startswith("fmax:")) + "\n"
    text = text.replace("    fmin: 0\n", "    fmin: 0\n" + line)
    cfg = model_config_from_yaml(read_hyperpyyaml(text), ModelConfig.tiny().llm.qwen2.to_hf())
    assert cfg.feat.fmax == fmax


def test_rendered_yaml_keeps_fmax_none():
    cfg = ModelConfig(feat=FeatureConfig.for_family(Family.COSYVOICE3))
    assert "fmax: null" in render_yaml(cfg)
    assert model_config_from_yaml(read_hyperpyyaml(render_yaml(cfg)), cfg.llm.qwen2.to_hf()) == cfg


def test_cosyvoice3_prompt_mel_spans_to_nyquist():
    rate = 24000
    t = torch.arange(rate) / rate
    tone = 0.5 * torch.sin(2 * math.pi * 10500 * t)[None]  # above CosyVoice2's 8 kHz top, below 12 kHz
    v2 = prompt_mel(tone, FeatureConfig.for_family(Family.COSYVOICE2))
    v3 = prompt_mel(tone, FeatureConfig.for_family(Family.COSYVOICE3))
    assert v2.shape == v3.shape == (1, rate // 480, 80)
    inner = slice(2, -2)  # away from the reflect-padded edges
    assert v3[0, inner].max() > v2[0, inner].max() + 4  # the tone lies in CosyVoice3's filterbank only
    assert v3[0, inner].max(dim=0).values.argmax() >= 70  # in its top bins
    assert torch.equal(v3, prompt_mel(tone, FeatureConfig(fmax=rate / 2)))  # None is the Nyquist rate
