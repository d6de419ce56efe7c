"""The model folder contract: find it, check it, load it strictly (seeded random models: `random_model`).

A released CosyVoice2-0.5B folder holds `llm.pt`, `flow.pt`, `hift.pt` (plain state dicts, loaded with
`weights_only=True`, never unpickled), two ONNX frontend models, `cosyvoice2.yaml` (read as data, see
`yaml_config`) and the Qwen2 tokenizer folder `CosyVoice-BlankEN/`. Every problem becomes one
`CheckpointError` line that names the file and what is wrong with it.
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig
from .errors import CheckpointError, first_sentence
from .models.flow import Flow
from .models.hift import HiFT, normalize_hift_keys
from .models.llm import SpeechLLM
from .yaml_config import model_config_from_yaml, read_hyperpyyaml

DEFAULT_MODEL_DIR = Path("pretrained_models") / "CosyVoice2-0.5B"
WHERE_TO_GET = (
    "download CosyVoice2-0.5B from ModelScope (iic/CosyVoice2-0.5B) or Hugging Face (FunAudioLLM/CosyVoice2-0.5B) "
    "and pass --model-dir or set COSYVOICE_MODEL_DIR"
)
TOKENIZER_DIR = "CosyVoice-BlankEN"
REQUIRED_FILES = (
    "cosyvoice2.yaml",
    "llm.pt",
    "flow.pt",
    "hift.pt",
    "campplus.onnx",
    "speech_tokenizer_v2.onnx",
    f"{TOKENIZER_DIR}/config.json",
    f"{TOKENIZER_DIR}/vocab.json",
    f"{TOKENIZER_DIR}/merges.txt",
)


@dataclass
class LoadedModel:
    """The three networks plus where the frontend finds its files."""

    config: ModelConfig
    llm: SpeechLLM
    flow: Flow
    hift: HiFT
    model_dir: Path  # for a random model: the folder holding its generated frontend files
    is_random: bool = False
    description: str = ""

    @property
    def tokenizer_dir(self) -> Path:
        return self.model_dir / TOKENIZER_DIR

    @property
    def speech_tokenizer_path(self) -> Path:
        return self.model_dir / "speech_tokenizer_v2.onnx"

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


def missing_files(model_dir: Path) -> list[str]:
    return [name for name in REQUIRED_FILES if not (model_dir / name).is_file()]


def read_model_config(model_dir: Path) -> ModelConfig:
    """Hyperparameters from `cosyvoice2.yaml` and `CosyVoice-BlankEN/config.json` (never executed)."""
    try:
        doc = read_hyperpyyaml((model_dir / "cosyvoice2.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"cosyvoice2.yaml in {model_dir}: cannot be read as a CosyVoice2 config ({e})") from None
    except Exception as e:  # yaml.YAMLError and friends
        raise CheckpointError(f"cosyvoice2.yaml in {model_dir}: invalid YAML ({type(e).__name__})") from None
    qwen_path = model_dir / TOKENIZER_DIR / "config.json"
    try:
        qwen = json.loads(qwen_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{TOKENIZER_DIR}/config.json in {model_dir}: cannot be read ({e})") from None
    try:
        return model_config_from_yaml(doc, qwen)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"cosyvoice2.yaml in {model_dir}: missing or invalid setting {e}") from None


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


def check_state_dict(name: str, sd: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Strict key and shape check with a precise message (strict `load_state_dict` errors are walls of text)."""
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


def build_modules(config: ModelConfig, device: str | torch.device = "cpu") -> tuple[SpeechLLM, Flow, HiFT]:
    """Modules of the right shapes on `device` (weights then come from a checkpoint or `randomize_`)."""
    with torch.device(device):
        return SpeechLLM(config.llm), Flow(config.flow), HiFT(config.hift)


def load_model(model_dir: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedModel:
    """Check every file, read the config, load the three state dicts strictly."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model folder {model_dir} does not exist; {WHERE_TO_GET}")
    missing = missing_files(model_dir)
    if missing:
        raise CheckpointError(f"model folder {model_dir} lacks {', '.join(missing)}; {WHERE_TO_GET}")
    config = read_model_config(model_dir)
    llm, flow, hift = build_modules(config, device)
    for name, module in (("llm", llm), ("flow", flow), ("hift", hift)):
        sd = read_state_dict(model_dir / f"{name}.pt")
        if name == "hift":
            sd = normalize_hift_keys(sd)
        check_state_dict(f"{name}.pt", sd, module)
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
