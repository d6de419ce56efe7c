"""The engine's process-wide CUDA library settings (engine/backends.py)."""

from __future__ import annotations

import os
import threading

import torch

from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.engine.backends import (
    CONV_PLAN_CACHE_ENV,
    CONV_PLAN_CACHE_LIMIT,
    configure_backends,
    cudnn_attention,
)


def test_cudnn_attention_off_and_conv_plan_cache_bounded_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv(CONV_PLAN_CACHE_ENV, raising=False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    configure_backends()
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert os.environ[CONV_PLAN_CACHE_ENV] == str(CONV_PLAN_CACHE_LIMIT)
    monkeypatch.setenv(CONV_PLAN_CACHE_ENV, "500")  # the user's value wins
    configure_backends()
    assert os.environ[CONV_PLAN_CACHE_ENV] == "500"


def test_an_engine_configures_the_backends(monkeypatch, tmp_path):
    monkeypatch.delenv(CONV_PLAN_CACHE_ENV, raising=False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    with Engine.from_model_dir(None, EngineConfig(random_size="tiny", device="cpu", warmup=False,
                                                  voices_dir=str(tmp_path))):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert os.environ[CONV_PLAN_CACHE_ENV] == str(CONV_PLAN_CACHE_LIMIT)


def test_cudnn_attention_is_on_inside_captures_and_restored_by_the_last_thread_out():
    """Two threads capturing at once, leaving in the other order than they came: the switch is on while either is
    inside and back off (as configured) once both are out; a plain save/restore would leave it on."""
    configure_backends()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def first():
        with cudnn_attention():
            first_in.set()
            second_in.wait(10)
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        first_out.set()

    def second():
        first_in.wait(10)
        with cudnn_attention():
            second_in.set()
            first_out.wait(10)
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())  # the other thread has left: still on

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == [True, True]
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)  # a process that did not configure the engine's backends
    with cudnn_attention():
        pass
    assert torch.backends.cuda.cudnn_sdp_enabled()
    configure_backends()
