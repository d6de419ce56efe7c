"""Shared test helpers: where the fixture sets live, skipping GPU tests on a machine without CUDA, waiting."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from _pytest.mark.structures import ParameterSet

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "tests" / "data"

# kind -> the variable that points at other sets (every set folder under it is tested); default tests/data/<kind>
FIXTURE_ENV = {"parity": "COSYVOICE_PARITY_DIR", "bistream": "COSYVOICE_BISTREAM_DIR",
               "parity-cv3": "COSYVOICE_PARITY_CV3_DIR"}


def in_ci() -> bool:
    """CI sets `CI=true`: there, missing fixture data is a failure, never a quiet skip."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def fixture_dir(kind: str) -> Path:
    """`$COSYVOICE_<KIND>_DIR` when set, else the sets shipped in the repository under `tests/data/<kind>`."""
    value = os.environ.get(FIXTURE_ENV[kind])
    return Path(value).expanduser() if value else DATA_DIR / kind


def fixture_sets(kind: str) -> list[Path]:
    """Every fixture set folder of `kind` (one per upstream configuration); empty if the folder is absent."""
    root = fixture_dir(kind)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir())


@dataclass(frozen=True)
class MissingSets:
    """The param value that stands for an absent or empty fixture folder under CI (`_fail_on_missing_sets`)."""

    reason: str


def missing_sets_param(kind: str) -> ParameterSet:
    """The one param that stands for "no sets of `kind`": skipped with the reason, or under CI a failing test."""
    reason = f"no {kind} fixture sets under {fixture_dir(kind)} (set {FIXTURE_ENV[kind]})"
    if in_ci():
        return pytest.param(MissingSets(reason), id="no-fixtures")
    return pytest.param(None, marks=pytest.mark.skip(reason=reason), id="no-fixtures")


@pytest.fixture(autouse=True)
def _fail_on_missing_sets(request: pytest.FixtureRequest) -> None:
    """A test parametrized with `MissingSets` fails with its reason before its body runs."""
    for value in getattr(getattr(request.node, "callspec", None), "params", {}).values():
        if isinstance(value, MissingSets):
            pytest.fail(value.reason)


def fixture_params(kind: str) -> list[ParameterSet]:
    """`pytest.mark.parametrize` values over the sets of `kind`, or the one param saying why there are none."""
    sets = fixture_sets(kind)
    return [pytest.param(s, id=s.name) for s in sets] if sets else [missing_sets_param(kind)]


def parity_dir() -> Path:
    """`$COSYVOICE_PARITY_DIR`, default `tests/data/parity` (the `tiny-a` set and its README)."""
    return fixture_dir("parity")


def parity_sets() -> list[Path]:
    return fixture_sets("parity")


def parity_params() -> list[ParameterSet]:
    return fixture_params("parity")


def bistream_dir() -> Path:
    """`$COSYVOICE_BISTREAM_DIR`, default `tests/data/bistream` (the `tiny-a` set)."""
    return fixture_dir("bistream")


def bistream_sets() -> list[Path]:
    return fixture_sets("bistream")


def bistream_params() -> list[ParameterSet]:
    return fixture_params("bistream")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu`-marked tests skip, with the reason, where CUDA is absent; `-m gpu` on a GPU machine runs them all."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture
def model_work(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts prompt-feature extractions (both ONNX models) and requests that reach the engine's queue: a request
    refused "before any model work" leaves both at 0."""
    from cosyvoice_opt.engine import engine as engine_module
    from cosyvoice_opt.engine.scheduler import Scheduler

    calls = {"features": 0, "queued": 0}
    extract, submit = engine_module.start_prompt_features, Scheduler.submit

    def counted_extract(*args, **kwargs):
        calls["features"] += 1
        return extract(*args, **kwargs)

    def counted_submit(self, req):
        calls["queued"] += 1
        return submit(self, req)

    monkeypatch.setattr(engine_module, "start_prompt_features", counted_extract)
    monkeypatch.setattr(Scheduler, "submit", counted_submit)
    return calls


def wait_until(pred: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll `pred` until it holds (True) or `timeout` seconds pass (False): for state other threads change and
    signal no event for. Where a test can wait on an event or a queue, it does that instead."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False
