"""The code base stays `ruff check` clean (configuration in pyproject.toml)."""

import subprocess
import sys

from tests.conftest import REPO_ROOT


def test_ruff_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
