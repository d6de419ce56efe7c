"""Shared test helpers: where the parity fixtures live."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def parity_dir() -> Path:
    """`$COSYVOICE_PARITY_DIR`, default `../shared/fixtures/parity` beside the repository."""
    return Path(os.environ.get("COSYVOICE_PARITY_DIR", REPO_ROOT.parent / "shared" / "fixtures" / "parity"))


def parity_sets() -> list[Path]:
    """Every fixture set folder (one per upstream configuration); empty if the folder is absent."""
    root = parity_dir()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir())


def parity_params():
    """`pytest.mark.parametrize` values over the sets, or one skipped param saying why there are none."""
    sets = parity_sets()
    if sets:
        return [pytest.param(s, id=s.name) for s in sets]
    reason = f"no parity fixture sets under {parity_dir()} (set COSYVOICE_PARITY_DIR)"
    return [pytest.param(None, marks=pytest.mark.skip(reason=reason), id="no-fixtures")]


def wait_until(pred: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll `pred` until it holds (True) or `timeout` seconds pass (False): for state other threads change."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False
