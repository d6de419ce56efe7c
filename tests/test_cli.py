"""The command lines (`cosyvoice-opt`, `python -m cosyvoice_opt`, `app.py`): usage names the command as invoked, and
every flag that can be refused is refused in one line before a model loads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from cosyvoice_opt import synth, webui
from cosyvoice_opt.__main__ import main as cli_main
from cosyvoice_opt.bench import cli as bench_cli
from cosyvoice_opt.bench.loopback import free_port, serve_in_process
from cosyvoice_opt.engine import Engine, EngineConfig
from tests.conftest import REPO_ROOT

# What pip writes as the `cosyvoice-opt` console script (pyproject's [project.scripts]).
CONSOLE_SCRIPT = """import sys
from cosyvoice_opt.__main__ import main
if __name__ == '__main__':
    sys.exit(main())
"""


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a model is loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for a run that had to be refused first")

    monkeypatch.setattr(Engine, "from_model_dir", refuse)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_usage_names_the_command_as_invoked(tmp_path):
    script = tmp_path / "cosyvoice-opt"
    script.write_text(CONSOLE_SCRIPT)
    console = _run(str(script), "--help")
    assert console.returncode == 0 and console.stdout.startswith("usage: cosyvoice-opt "), console.stdout
    assert "python -m" not in console.stdout
    sub = _run(str(script), "check-model", "--help")
    assert sub.stdout.startswith("usage: cosyvoice-opt check-model "), sub.stdout
    bench = _run(str(script), "bench", "--help")
    assert bench.stdout.startswith("usage: cosyvoice-opt bench "), bench.stdout
    cluster = _run(str(script), "cluster", "--help")
    assert cluster.stdout.startswith("usage: cosyvoice-opt cluster "), cluster.stdout
    module = _run("-m", "cosyvoice_opt", "--help")
    assert module.stdout.startswith("usage: python -m cosyvoice_opt "), module.stdout


def test_serve_and_synth_usage_name_their_subcommand(capsys, no_model):
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    assert capsys.readouterr().out.startswith("usage: python -m cosyvoice_opt serve ")
    with pytest.raises(SystemExit):
        cli_main(["synth", "--help"])
    assert capsys.readouterr().out.startswith("usage: python -m cosyvoice_opt synth ")


@pytest.mark.parametrize("command", [
    lambda flags: cli_main(["check-model", *flags]),
    lambda flags: synth.main([*flags, "--text", "hi"]),
    lambda flags: webui.main(flags),
], ids=["check-model", "synth", "serve"])
def test_random_and_model_dir_exclude_each_other(capsys, no_model, tmp_path, command):
    with pytest.raises(SystemExit) as done:
        command(["--random", "tiny", "--model-dir", str(tmp_path)])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--model-dir" in err and "--random" in err and "not allowed" in err, err


@pytest.mark.parametrize("auth", ["no-colon", ":nouser", "user:"])
def test_a_malformed_auth_is_refused_before_the_engine_loads(no_model, auth):
    with pytest.raises(SystemExit) as done:
        webui.main(["--random", "tiny", "--host", "127.0.0.1", "--port", str(free_port()), "--auth", auth])
    assert "--auth: expected user:pass" in str(done.value.code)


def test_a_port_in_use_is_refused_before_the_engine_loads(no_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as done:
            webui.main(["--random", "tiny", "--host", "127.0.0.1", "--port", str(port)])
    message = str(done.value.code)
    assert message.startswith(f"error: port {port} on 127.0.0.1 is not free") and "--port" in message, message
    assert "\n" not in message


def test_soak_with_a_wrong_api_key_is_one_line(tmp_path, capsys):
    engine = Engine.from_model_dir(None, EngineConfig(random_size="tiny", voices_dir=str(tmp_path), warmup=False))
    try:
        with serve_in_process(engine, api_key="right") as url:
            assert bench_cli.main(["--soak", "1", "--url", url, "--api-key", "WRONG"]) == 1
    finally:
        engine.close()
    err = capsys.readouterr().err
    assert err == f"error: {url} refused the API key (HTTP 401); check --api-key or COSYVOICE_API_KEY\n", err
