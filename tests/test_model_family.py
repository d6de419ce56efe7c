"""Model families: what a folder's files say it is, mixed folders refused by name, the family's prompt mel, and saved
voices that record the speech tokenizer their tokens came from."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cosyvoice_opt import checkpoint
from cosyvoice_opt.checkpoint import LoadedModel
from cosyvoice_opt.config import Family, FeatureConfig, ModelConfig
from cosyvoice_opt.errors import CheckpointError, InputError
from cosyvoice_opt.frontend.features import PromptFeatures, prompt_mel
from cosyvoice_opt.frontend.voices import VoiceStore
from cosyvoice_opt.yaml_config import model_config_from_yaml, read_hyperpyyaml, render_yaml
from tests.conftest import REPO_ROOT

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


# ---------------------------------------------------------------------------------------------------- the folder

CV3_YAML = """\
__set_seed1: !apply:random.seed [1986]
sample_rate: 24000
llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: 896
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: ''
flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: 80
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    fmax: null
"""


def _folder(path: Path, family: Family) -> Path:
    """A folder with the family's file names (contents only where detection reads them)."""
    path.mkdir(parents=True)
    for name in checkpoint.required_files(family):
        (path / name).parent.mkdir(exist_ok=True)
        (path / name).write_bytes(b"")
    yaml_text = CV3_YAML if family == Family.COSYVOICE3 else render_yaml(ModelConfig.tiny())
    (path / checkpoint.YAML_FILES[family]).write_text(yaml_text)
    return path


def test_required_files_per_family():
    v3 = checkpoint.required_files(Family.COSYVOICE3)
    assert {"cosyvoice3.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v3.onnx",
            "CosyVoice-BlankEN/vocab.json"} <= set(v3)
    assert not {"cosyvoice2.yaml", "speech_tokenizer_v2.onnx"} & set(v3)
    assert checkpoint.required_files(Family.COSYVOICE2) == checkpoint.REQUIRED_FILES


def test_family_is_read_from_the_files_not_the_name(tmp_path):
    # Each folder is named after the other family: the name is never read.
    assert checkpoint.detect_family(_folder(tmp_path / "Fun-CosyVoice3-0.5B", Family.COSYVOICE2)) == Family.COSYVOICE2
    assert checkpoint.detect_family(_folder(tmp_path / "CosyVoice2-0.5B", Family.COSYVOICE3)) == Family.COSYVOICE3


def test_speech_tokenizer_path_follows_the_family(tmp_path):
    model = LoadedModel(ModelConfig.tiny(Family.COSYVOICE3), None, None, None, tmp_path)
    assert model.family == Family.COSYVOICE3  # the config's: one source of truth
    assert model.speech_tokenizer_path == tmp_path / "speech_tokenizer_v3.onnx"
    v2 = dataclasses.replace(model, config=ModelConfig.tiny())
    assert v2.speech_tokenizer_path.name == "speech_tokenizer_v2.onnx"


def _error(folder: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        checkpoint.detect_family(folder)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_mixed_folders_are_one_clear_error(tmp_path):
    both = _folder(tmp_path / "both", Family.COSYVOICE3)
    (both / "cosyvoice2.yaml").write_text(render_yaml(ModelConfig.tiny()))
    assert "holds both cosyvoice2.yaml and cosyvoice3.yaml" in _error(both)

    v2_tokenizer = _folder(tmp_path / "tok2", Family.COSYVOICE3)
    (v2_tokenizer / "speech_tokenizer_v2.onnx").write_bytes(b"")
    assert _error(v2_tokenizer).startswith("speech_tokenizer_v2.onnx is CosyVoice2's speech tokenizer, in a "
                                           "CosyVoice3 folder (it holds cosyvoice3.yaml)")
    v3_tokenizer = _folder(tmp_path / "tok3", Family.COSYVOICE2)
    (v3_tokenizer / "speech_tokenizer_v3.onnx").write_bytes(b"")
    assert _error(v3_tokenizer).startswith("speech_tokenizer_v3.onnx is CosyVoice3's speech tokenizer")

    wrong_class = _folder(tmp_path / "cls", Family.COSYVOICE3)
    text = CV3_YAML.replace("flow.CausalMaskedDiffWithDiT", "flow.CausalMaskedDiffWithXvec")
    (wrong_class / "cosyvoice3.yaml").write_text(text)
    assert _error(wrong_class) == ("cosyvoice3.yaml: `flow` builds CausalMaskedDiffWithXvec, a CosyVoice2 class; "
                                   "a CosyVoice3 yaml builds CausalMaskedDiffWithDiT")
    untagged = CV3_YAML.replace("hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator", "hift:")
    (wrong_class / "cosyvoice3.yaml").write_text(untagged)
    assert "`hift` builds no class" in _error(wrong_class)
    (wrong_class / "cosyvoice3.yaml").write_text(CV3_YAML.replace("CosyVoice3LM", "MyLM"))
    assert "`llm` builds MyLM, no CosyVoice class" in _error(wrong_class)
    (wrong_class / "cosyvoice3.yaml").write_text("llm: [unclosed")
    assert _error(wrong_class).startswith("cosyvoice3.yaml: cannot be read as YAML")


def test_folder_without_a_yaml_is_named(tmp_path):
    folder = _folder(tmp_path / "none", Family.COSYVOICE3)
    (folder / "cosyvoice3.yaml").unlink()
    assert "holds neither cosyvoice2.yaml nor cosyvoice3.yaml" in _error(folder)


def test_loader_checks_the_cosyvoice3_file_list(tmp_path):
    folder = _folder(tmp_path / "v3", Family.COSYVOICE3)
    (folder / "speech_tokenizer_v3.onnx").unlink()
    (folder / "hift.pt").unlink()
    with pytest.raises(CheckpointError, match=r"^CosyVoice3 model folder .* lacks hift\.pt, speech_tokenizer_v3\.onnx"):
        checkpoint.load_model(folder)


# ---------------------------------------------------------------------------------------------------- voices


def _voice_features(n: int = 9) -> PromptFeatures:
    g = torch.Generator().manual_seed(0)
    return PromptFeatures(torch.randint(0, 6561, (1, n), generator=g, dtype=torch.int32),
                          torch.randn(1, 192, generator=g), torch.randn(1, 2 * n, 80, generator=g))


def test_saved_voice_records_its_family(tmp_path):
    """The store records and reports the family whose speech tokens a voice holds, whichever family's store reads
    it (the engine decides what a voice of the other family needs: tests/test_voices_families.py)."""
    v3 = VoiceStore(tmp_path, builtin_dir=None, family=Family.COSYVOICE3)
    v3.save("anna", _voice_features(), {"prompt_text": "你好"})
    assert json.loads((tmp_path / "anna.json").read_text())["family"] == "cosyvoice3"
    assert torch.equal(v3.load("anna").features.speech_tokens, _voice_features().speech_tokens)
    v2 = VoiceStore(tmp_path, builtin_dir=None, family=Family.COSYVOICE2)
    assert v2.load("anna").family == v3.load("anna").family == Family.COSYVOICE3
    v2.save("ben", _voice_features())
    assert v3.load("ben").family == Family.COSYVOICE2
    assert v3.families("ben") == [Family.COSYVOICE2]  # no audio: only its own family


def test_voices_saved_before_families_are_cosyvoice2(tmp_path):
    VoiceStore(tmp_path, builtin_dir=None).save("old", _voice_features())
    meta_path = tmp_path / "old.json"
    meta = json.loads(meta_path.read_text())
    del meta["family"]
    meta_path.write_text(json.dumps(meta | {"format_version": 1}))
    assert VoiceStore(tmp_path, builtin_dir=None).load("old").name == "old"
    assert VoiceStore(tmp_path, builtin_dir=None, family=Family.COSYVOICE3).load("old").family == Family.COSYVOICE2
    meta_path.write_text(json.dumps(meta | {"family": "cosyvoice9"}))
    with pytest.raises(InputError, match="names an unknown model family 'cosyvoice9'"):
        VoiceStore(tmp_path, builtin_dir=None).load("old")


def test_check_model_names_the_file_that_does_not_belong(tmp_path):
    folder = _folder(tmp_path / "mixed", Family.COSYVOICE3)
    (folder / "speech_tokenizer_v2.onnx").write_bytes(b"")
    result = subprocess.run([sys.executable, "-m", "cosyvoice_opt", "check-model", "--model-dir", str(folder)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: speech_tokenizer_v2.onnx is CosyVoice2's speech tokenizer, in a "
                                    "CosyVoice3 folder")
