"""The model folder contract: find it, check it, load it strictly (seeded random models: `random_model`).

A released CosyVoice2-0.5B folder holds `llm.pt`, `flow.pt`, `hift.pt` (plain state dicts, loaded with
`weights_only=True`, never unpickled), two ONNX frontend models, `cosyvoice2.yaml` (read as data, see
`yaml_config`) and the Qwen2 tokenizer folder `CosyVoice-BlankEN/`. A Fun-CosyVoice3-0.5B folder holds
`cosyvoice3.yaml` and `speech_tokenizer_v3.onnx` instead. The family is read from the files (`detect_family`), never
from the folder's name. Every problem becomes one `CheckpointError` line that names the file and what is wrong with it.
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from .config import Family, ModelConfig
from .errors import CheckpointError, first_sentence
from .models.causal_hift import CausalHiFT
from .models.flow import Flow, FlowBase
from .models.flow_dit import FlowDiT
from .models.hift import HiFT, HiFTBase, normalize_hift_keys
from .models.llm import SpeechLLM
from .yaml_config import model_config_from_yaml, read_hyperpyyaml

DEFAULT_MODEL_DIR = Path("pretrained_models") / "CosyVoice2-0.5B"
WHERE_TO_GET = (
    "download CosyVoice2-0.5B from ModelScope (iic/CosyVoice2-0.5B) or Hugging Face (FunAudioLLM/CosyVoice2-0.5B) "
    "and pass --model-dir or set COSYVOICE_MODEL_DIR"
)
TOKENIZER_DIR = "CosyVoice-BlankEN"
YAML_FILES = {Family.COSYVOICE2: "cosyvoice2.yaml", Family.COSYVOICE3: "cosyvoice3.yaml"}
SPEECH_TOKENIZER_FILES = {Family.COSYVOICE2: "speech_tokenizer_v2.onnx", Family.COSYVOICE3: "speech_tokenizer_v3.onnx"}
# The upstream class each family's yaml builds (its `!new:` tag), per top-level key.
YAML_CLASSES = {
    Family.COSYVOICE2: {"llm": "Qwen2LM", "flow": "CausalMaskedDiffWithXvec", "hift": "HiFTGenerator"},
    Family.COSYVOICE3: {"llm": "CosyVoice3LM", "flow": "CausalMaskedDiffWithDiT", "hift": "CausalHiFTGenerator"},
}
FAMILY_NAMES = {Family.COSYVOICE2: "CosyVoice2", Family.COSYVOICE3: "CosyVoice3"}


def required_files(family: Family) -> tuple[str, ...]:
    """The files a folder of `family` must hold (`spk2info.pt` is optional)."""
    return (
        YAML_FILES[family],
        "llm.pt",
        "flow.pt",
        "hift.pt",
        "campplus.onnx",
        SPEECH_TOKENIZER_FILES[family],
        f"{TOKENIZER_DIR}/config.json",
        f"{TOKENIZER_DIR}/vocab.json",
        f"{TOKENIZER_DIR}/merges.txt",
    )


REQUIRED_FILES = required_files(Family.COSYVOICE2)


def _yaml_classes(path: Path) -> dict[str, str]:
    """{top-level key: class name} of the yaml's `!new:` nodes, read from the node graph (nothing is built)."""
    try:
        root = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise CheckpointError(f"{path.name}: cannot be read as YAML ({type(e).__name__})") from None
    if not isinstance(root, yaml.MappingNode):
        raise CheckpointError(f"{path.name}: the top level is not a mapping")
    return {key.value: value.tag.removeprefix("!new:").rsplit(".", 1)[-1]
            for key, value in root.value if isinstance(key, yaml.ScalarNode) and value.tag.startswith("!new:")}


def detect_family(model_dir: str | os.PathLike) -> Family:
    """The family of a model folder, from which yaml it holds and the classes that yaml builds; a folder mixing the
    families' files is one error naming the file that does not belong."""
    model_dir = Path(model_dir)
    found = [family for family, name in YAML_FILES.items() if (model_dir / name).is_file()]
    if not found:
        raise CheckpointError(f"model folder {model_dir} holds neither cosyvoice2.yaml nor cosyvoice3.yaml, so it "
                              f"is no CosyVoice model folder; {WHERE_TO_GET}")
    if len(found) > 1:
        raise CheckpointError(f"model folder {model_dir} holds both cosyvoice2.yaml and cosyvoice3.yaml: a folder is "
                              "one model; remove the yaml of the family its weights are not")
    family = found[0]
    name = FAMILY_NAMES[family]
    classes = _yaml_classes(model_dir / YAML_FILES[family])
    for key, expected in YAML_CLASSES[family].items():
        got = classes.get(key)
        if got != expected:
            owner = next((FAMILY_NAMES[f] for f, c in YAML_CLASSES.items() if c[key] == got), None)
            what = "no class" if got is None else f"{got}, a {owner} class" if owner else f"{got}, no CosyVoice class"
            raise CheckpointError(f"{YAML_FILES[family]}: `{key}` builds {what}; a {name} yaml builds {expected}")
    for other, tokenizer in SPEECH_TOKENIZER_FILES.items():
        if other != family and (model_dir / tokenizer).exists():
            raise CheckpointError(f"{tokenizer} is {FAMILY_NAMES[other]}'s speech tokenizer, in a {name} folder "
                                  f"(it holds {YAML_FILES[family]}); a {name} folder uses "
                                  f"{SPEECH_TOKENIZER_FILES[family]}: remove {tokenizer}")
    return family


@dataclass
class LoadedModel:
    """The three networks plus where the frontend finds its files."""

    config: ModelConfig
    llm: SpeechLLM
    flow: FlowBase  # `Flow` (CosyVoice2) or `FlowDiT` (CosyVoice3)
    hift: HiFTBase  # `HiFT` (CosyVoice2) or `CausalHiFT` (CosyVoice3)
    model_dir: Path  # for a random model: the folder holding its generated frontend files
    is_random: bool = False
    description: str = ""

    @property
    def family(self) -> Family:
        return self.config.family

    @property
    def tokenizer_dir(self) -> Path:
        return self.model_dir / TOKENIZER_DIR

    @property
    def speech_tokenizer_path(self) -> Path:
        return self.model_dir / SPEECH_TOKENIZER_FILES[self.family]

    @property
    def campplus_path(self) -> Path:
        return self.model_dir / "campplus.onnx"

    @property
    def spk2info_path(self) -> Path:
        return self.model_dir / "spk2info.pt"

    def parts(self) -> dict[str, nn.Module]:
        return {"llm": self.llm, "flow": self.flow, "hift": self.hift}


def find_model_dir(explicit: str | os.PathLike | None = None) -> Path | None:
    """`explicit`, else `$COSYVOICE_MODEL_DIR`, else `pretrained_models/CosyVoice2-0.5B`; None if none exists.

    A folder the user named explicitly (argument or variable) must exist: that is an error, not a fallback.
    """
    for source, value in (("--model-dir", explicit), ("COSYVOICE_MODEL_DIR", os.environ.get("COSYVOICE_MODEL_DIR"))):
        if value:
            path = Path(value).expanduser()
            if not path.is_dir():
                raise CheckpointError(f"{source} {path} is not a folder; {WHERE_TO_GET}")
            return path
    for base in (Path.cwd(), Path(__file__).resolve().parent.parent):
        if (base / DEFAULT_MODEL_DIR).is_dir():
            return base / DEFAULT_MODEL_DIR
    return None


def missing_files(model_dir: Path, family: Family = Family.COSYVOICE2) -> list[str]:
    return [name for name in required_files(family) if not (model_dir / name).is_file()]


def read_model_config(model_dir: Path, family: Family = Family.COSYVOICE2) -> ModelConfig:
    """Hyperparameters from the family's yaml and `CosyVoice-BlankEN/config.json` (never executed)."""
    name = YAML_FILES[family]
    try:
        doc = read_hyperpyyaml((model_dir / name).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{name} in {model_dir}: cannot be read as a {FAMILY_NAMES[family]} config "
                              f"({e})") from None
    except Exception as e:  # yaml.YAMLError and friends
        raise CheckpointError(f"{name} in {model_dir}: invalid YAML ({type(e).__name__})") from None
    qwen_path = model_dir / TOKENIZER_DIR / "config.json"
    try:
        qwen = json.loads(qwen_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{TOKENIZER_DIR}/config.json in {model_dir}: cannot be read ({e})") from None
    try:
        return model_config_from_yaml(doc, qwen, family)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{name} in {model_dir}: missing or invalid setting {e}") from None


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """`torch.load(weights_only=True)`; a truncated, corrupt or pickle-bearing file is one clear line."""
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError, ValueError, OSError) as e:
        first = first_sentence(e)
        if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in first:
            reason = "it contains Python objects, not just tensors, and is refused (no pickles are executed)"
        else:
            reason = f"truncated or corrupt ({first})"
        raise CheckpointError(f"{path.name}: cannot be loaded: {reason}; re-download it ({WHERE_TO_GET})") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path.name}: not a state dict of tensors")
    return sd


def state_dict_family(name: str, sd: dict[str, torch.Tensor]) -> Family | None:
    """Which family's network a `llm.pt` / `flow.pt` / `hift.pt` state dict is, from keys only one family has (the
    LLM's separate sos/task_id table and head bias, the flow's conformer projection or pre-lookahead layer, the
    vocoder's transposed or causal up-sampling convs); None if it looks like neither."""
    if name == "llm.pt":
        if "llm_embedding.weight" in sd:
            return Family.COSYVOICE2
        return Family.COSYVOICE3 if "speech_embedding.weight" in sd and "llm_decoder.bias" not in sd else None
    if name == "flow.pt":
        if "encoder_proj.weight" in sd:
            return Family.COSYVOICE2
        return Family.COSYVOICE3 if any(k.startswith("pre_lookahead_layer.") for k in sd) else None
    if name == "hift.pt":
        up = sd.get("ups.0.parametrizations.weight.original1")
        if up is None or up.dim() != 3:
            return None
        # ConvTranspose1d weights are [in, out, k] and the channels halve; the causal Conv1d's are [out, in, k]
        return Family.COSYVOICE2 if up.shape[0] > up.shape[1] else Family.COSYVOICE3
    return None


def check_state_dict(name: str, sd: dict[str, torch.Tensor], model: nn.Module,
                     family: Family | None = None) -> None:
    """Strict key and shape check with a precise message (strict `load_state_dict` errors are walls of text); with
    `family`, a file of the other family's network says so."""
    if family is not None:
        found = state_dict_family(name, sd)
        if found is not None and found != family:
            raise CheckpointError(f"{name}: holds a {FAMILY_NAMES[found]} network, but the folder is "
                                  f"{FAMILY_NAMES[family]} ({YAML_FILES[family]}); use the {name} of the same "
                                  "release as the yaml")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(expected.keys() - sd.keys())
    unexpected = sorted(sd.keys() - expected.keys())
    shapes = sorted(k for k in expected.keys() & sd.keys() if tuple(sd[k].shape) != expected[k])
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s) e.g. {missing[0]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s) e.g. {unexpected[0]}")
    if shapes:
        k = shapes[0]
        problems.append(
            f"{len(shapes)} mis-shaped key(s) e.g. {k} is {list(sd[k].shape)}, expected {list(expected[k])}"
        )
    if problems:
        raise CheckpointError(f"{name}: does not match the model: " + "; ".join(problems))


def build_modules(config: ModelConfig, device: str | torch.device = "cpu") -> tuple[SpeechLLM, FlowBase, HiFTBase]:
    """The family's modules of the right shapes on `device` (weights then come from a checkpoint or `randomize_`)."""
    v3 = config.family == Family.COSYVOICE3
    with torch.device(device):
        flow = FlowDiT(config.flow) if v3 else Flow(config.flow)
        return SpeechLLM(config.llm), flow, CausalHiFT(config.hift) if v3 else HiFT(config.hift)


def load_model(model_dir: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedModel:
    """Check every file, read the config, load the three state dicts strictly."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model folder {model_dir} does not exist; {WHERE_TO_GET}")
    family = detect_family(model_dir)
    missing = missing_files(model_dir, family)
    if missing:
        raise CheckpointError(f"{FAMILY_NAMES[family]} model folder {model_dir} lacks {', '.join(missing)}; "
                              f"{WHERE_TO_GET}")
    config = read_model_config(model_dir, family)
    llm, flow, hift = build_modules(config, device)
    for name, module in (("llm", llm), ("flow", flow), ("hift", hift)):
        sd = read_state_dict(model_dir / f"{name}.pt")
        if name == "hift":
            sd = normalize_hift_keys(sd)
        check_state_dict(f"{name}.pt", sd, module, family)
        module.load_state_dict(sd, strict=True)
        module.eval()
    return LoadedModel(config, llm, flow, hift, model_dir, description=str(model_dir))


def parameter_count(module: nn.Module) -> int:
    """Unique parameter elements (a tied tensor counts once), as in the checkpoint contract."""
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
