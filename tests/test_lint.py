"""The code base stays `ruff check` clean, and its imports flow one way (both configured in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

_LINT_IMPORTS = "import sys, importlinter.cli as c; sys.exit(c.lint_imports(no_cache=True, no_logo=True))"


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter over the `cosyvoice_opt` package under `root`, with `root`'s pyproject.toml."""
    return subprocess.run([sys.executable, "-c", _LINT_IMPORTS], cwd=root, capture_output=True, text=True)


def test_ruff_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_imports_flow_one_way():
    """config/types/limits/errors, models and frontend import nothing from the engine up; the engine imports nothing
    from the server, the UI or the benchmarks."""
    result = _lint_imports(REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def _copy_with_import(tmp_path: Path, module: str, statement: str) -> Path:
    """A copy of the package and pyproject.toml under `tmp_path` whose `module` (a path) ends with `statement`."""
    package = tmp_path / "cosyvoice_opt"
    shutil.copytree(REPO_ROOT / "cosyvoice_opt", package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path)
    with open(package / module, "a", encoding="utf-8") as f:
        f.write(f"\n{statement}  # noqa: E402,F401\n")
    return tmp_path


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The contract checks something: the frontend importing the engine is reported."""
    result = _lint_imports(_copy_with_import(tmp_path, "frontend/tokenizer.py",
                                             "from cosyvoice_opt.engine import Engine"))
    assert result.returncode != 0
    assert "cosyvoice_opt.frontend is not allowed to import cosyvoice_opt.engine" in result.stdout, result.stdout


def test_one_benchmark_importing_another_breaks_the_contract(tmp_path):
    """The benchmarks stay apart: the soak importing the serving benchmark is reported."""
    result = _lint_imports(_copy_with_import(tmp_path, "bench/soak.py", "from cosyvoice_opt.bench import serving"))
    assert result.returncode != 0
    assert "cosyvoice_opt.bench.soak is not allowed to import cosyvoice_opt.bench.serving" in result.stdout, \
        result.stdout
