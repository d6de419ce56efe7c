"""The model-folder contract: strict loading, precise one-line errors, random folders, check-model."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cosyvoice_opt import checkpoint
from cosyvoice_opt.config import ModelConfig
from cosyvoice_opt.errors import CheckpointError, first_sentence
from cosyvoice_opt.random_model import random_model, write_random_model_folder
from cosyvoice_opt.yaml_config import model_config_from_yaml, read_hyperpyyaml, render_yaml
from tests.conftest import REPO_ROOT

KEYS_FILE = REPO_ROOT / "cosyvoice_opt" / "checkpoint_keys.txt"


def contract() -> dict[str, dict]:
    """Per file of the released folder: {key: shape} and the unique element count, from the key list."""
    parts: dict[str, dict] = {}
    current = None
    for line in KEYS_FILE.read_text().splitlines():
        header = re.match(r"### (\w+)\.pt .*unique_elements=(\d+)", line)
        if header:
            current = parts.setdefault(header.group(1), {"keys": {}, "unique": int(header.group(2))})
        elif current is not None and line and not line.startswith("#"):
            key, shape, _dtype = line.split("\t")
            current["keys"][key] = tuple(int(d) for d in shape.split("x")) if shape else ()
    return parts


def test_release_yaml_is_read_as_data():
    doc = read_hyperpyyaml((REPO_ROOT / "tests" / "data" / "cosyvoice2_release_layout.yaml").read_text())
    cfg = model_config_from_yaml(doc, ModelConfig.full().llm.qwen2.to_hf())
    assert cfg == ModelConfig.full()
    assert doc["flow"]["decoder"]["estimator"]["static_chunk_size"] == 50  # `!ref <a> * <b>` evaluated


@pytest.mark.parametrize("cfg", [ModelConfig.full(), ModelConfig.tiny()], ids=["full", "tiny"])
def test_rendered_yaml_round_trips(cfg):
    assert model_config_from_yaml(read_hyperpyyaml(render_yaml(cfg)), cfg.llm.qwen2.to_hf()) == cfg


def test_full_size_modules_match_the_key_list():
    expected = contract()
    llm, flow, hift = checkpoint.build_modules(ModelConfig.full(), "meta")
    for name, module in (("llm", llm), ("flow", flow), ("hift", hift)):
        ours = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        assert ours == expected[name]["keys"], name
        assert checkpoint.parameter_count(module) == expected[name]["unique"], name


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return write_random_model_folder(tmp_path_factory.mktemp("tiny"), "tiny", seed=3)


def test_tiny_folder_loads_strictly_with_same_weights(tiny_folder):
    model = checkpoint.load_model(tiny_folder)
    again = random_model("tiny", seed=3, frontend_dir=tiny_folder)
    for name, module in model.parts().items():
        for (k, a), (_, b) in zip(module.state_dict().items(), again.parts()[name].state_dict().items(), strict=True):
            assert torch.equal(a, b), f"{name}.{k}"
    assert model.config == ModelConfig.tiny()


def _copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_file_is_named(tiny_folder, tmp_path):
    folder = _copy_folder(tiny_folder, tmp_path / "m")
    (folder / "flow.pt").unlink()
    with pytest.raises(CheckpointError, match=r"lacks flow\.pt; download CosyVoice2-0\.5B") as e:
        checkpoint.load_model(folder)
    assert "\n" not in str(e.value)


def test_truncated_file_is_one_line(tiny_folder, tmp_path):
    folder = _copy_folder(tiny_folder, tmp_path / "t")
    data = (folder / "llm.pt").read_bytes()
    (folder / "llm.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"^llm\.pt: cannot be loaded: truncated or corrupt") as e:
        checkpoint.load_model(folder)
    assert "\n" not in str(e.value)
    with pytest.raises(Exception) as original:
        torch.load(folder / "llm.pt", weights_only=True, mmap=True)
    # torch's reason, quoted up to the end of a sentence, never cut mid-sentence
    reason = re.search(r"truncated or corrupt \((.*?)\); re-download", str(e.value)).group(1)
    rest = str(original.value).strip()
    assert rest.startswith(reason) and rest[len(reason):][:1] in ("", ".", "\n"), (reason, rest)


def test_first_sentence_of_a_library_error():
    assert first_sentence(RuntimeError("a failed. This is internal. If you\nsee this")) == "a failed"
    assert first_sentence(ValueError()) == "ValueError"
    long = first_sentence(RuntimeError("word " * 100))
    assert long.endswith("word…") and len(long) <= 161


def test_wrong_shape_is_named(tiny_folder, tmp_path):
    folder = _copy_folder(tiny_folder, tmp_path / "s")
    sd = torch.load(folder / "hift.pt", weights_only=True)
    sd["conv_pre.bias"] = torch.zeros(7)
    sd["extra.weight"] = torch.zeros(1)
    torch.save(sd, folder / "hift.pt")
    with pytest.raises(CheckpointError) as e:
        checkpoint.load_model(folder)
    msg = str(e.value)
    assert msg.startswith("hift.pt: does not match the model")
    assert "1 unexpected key(s) e.g. extra.weight" in msg
    assert "conv_pre.bias is [7], expected [" in msg


def test_pickle_payload_is_refused(tiny_folder, tmp_path):
    folder = _copy_folder(tiny_folder, tmp_path / "p")
    torch.save({"weights": torch.zeros(1), "evil": Path("x")}, folder / "flow.pt")
    with pytest.raises(CheckpointError, match=r"^flow\.pt: cannot be loaded: it contains Python objects"):
        checkpoint.load_model(folder)


def test_explicit_missing_folder_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="is not a folder"):
        checkpoint.find_model_dir(tmp_path / "nope")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cosyvoice_opt", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)


def test_check_model_cli_ok_and_bad(tiny_folder, tmp_path):
    ok = _cli("check-model", "--model-dir", str(tiny_folder))
    assert ok.returncode == 0, ok.stderr
    assert "verdict: loadable" in ok.stdout and "tokenizer: " in ok.stdout
    assert "speech tokenizer: the released network (1 blocks of 64): runs in PyTorch on a GPU" in ok.stdout
    other = _copy_folder(tiny_folder, tmp_path / "other")
    shutil.copy(other / "campplus.onnx", other / "speech_tokenizer_v2.onnx")  # a valid ONNX file of another network
    ok = _cli("check-model", "--model-dir", str(other))
    assert ok.returncode == 0, ok.stderr
    assert ("speech tokenizer: runs in onnxruntime on the host (speech_tokenizer_v2.onnx: not the S3Tokenizer v2 "
            "network") in ok.stdout, ok.stdout
    bad = _copy_folder(tiny_folder, tmp_path / "bad")
    (bad / "hift.pt").write_bytes(b"not a checkpoint")
    result = _cli("check-model", "--model-dir", str(bad))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("error: hift.pt: cannot be loaded")


@pytest.mark.parametrize("name", ["vocab.json", "merges.txt"])
def test_check_model_loads_the_tokenizer(tiny_folder, tmp_path, name):
    """A corrupt tokenizer file fails check-model with one line, as it would fail `serve` and `synth`."""
    bad = _copy_folder(tiny_folder, tmp_path / "bad")
    path = bad / checkpoint.TOKENIZER_DIR / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if name == "vocab.json" else b"not a merge rule line\n" + data)
    result = _cli("check-model", "--model-dir", str(bad))
    assert result.returncode == 1, result.stdout
    assert "verdict" not in result.stdout and result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith(f"error: tokenizer folder {checkpoint.TOKENIZER_DIR}/ cannot be loaded"), \
        result.stderr


def test_check_model_random_full_counts_match_key_list():
    result = _cli("check-model", "--random", "full")
    assert result.returncode == 0, result.stderr
    expected = contract()
    for name in ("llm", "flow", "hift"):
        line = next(ln for ln in result.stdout.splitlines() if ln.startswith(name + " "))
        assert f"{expected[name]['unique'] / 1e6:.1f}M" in line, line


def test_full_random_folder_round_trip(tmp_path):
    """The released shapes written as a folder load back strictly (2.6 GB on disk)."""
    folder = write_random_model_folder(tmp_path / "full", "full", seed=1)
    model = checkpoint.load_model(folder)
    assert model.config == ModelConfig.full()
    sd = torch.load(folder / "llm.pt", weights_only=True, mmap=True)
    assert set(sd) == set(contract()["llm"]["keys"])
    assert model.llm.state_dict()["llm.model.lm_head.weight"].data_ptr() == \
        model.llm.state_dict()["llm.model.model.embed_tokens.weight"].data_ptr()
