"""A server's engine (tiny random model, CPU, `exit_on_fatal`) meets an injected fatal CUDA error while it holds a
request in each stage: one whose audio is being made (its LLM done), one the LLM is decoding, one waiting in the
queue. Run as a script by tests/test_admission.py, which reads what it prints (one JSON object a line) and its exit
code. The process is expected to end by the engine's own exit (code 70); if none comes it exits 0 itself.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading

import torch
from fastapi import FastAPI
from starlette.testclient import TestClient

from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.errors import CosyVoiceError
from cosyvoice_opt.random_model import random_model
from cosyvoice_opt.server import mount_api
from cosyvoice_opt.server.openai_api import engine_error
from cosyvoice_opt.types import SynthesisRequest
from tests.conftest import wait_until
from tests.test_engine import prompt_wav

NO_EXIT_S = 30.0  # how long the engine gets to exit by itself once every request has its answer


SAY = threading.Lock()  # the three requests answer from their own threads: one whole line at a time


def say(**fields) -> None:
    with SAY:
        print(json.dumps(fields), flush=True)


def main() -> None:
    engine = Engine(lambda d: random_model("tiny", 0, d),
                    EngineConfig(random_size="tiny", device="cpu", max_batch_size=1, max_queue_wait=600,
                                 exit_on_fatal=True, voices_dir=tempfile.mkdtemp()))
    app = FastAPI()
    mount_api(app, engine, None)
    client = TestClient(app)
    say(event="ready_before", status=client.get("/health/ready").status_code)

    # the vocoder stops at its first round (the request stays in the audio stage); decode, once armed, stops too
    # and then raises the fault
    vocoder, runner = engine._parts.vocoder, engine._parts.runner
    vocoding, held, decoding, fault, armed = (threading.Event() for _ in range(5))
    run_round, decode = vocoder._run, runner.decode

    def stuck_round(jobs):
        vocoding.set()
        held.wait()
        return run_round(jobs)

    def faulty_decode(*args, **kwargs):
        if armed.is_set():
            decoding.set()
            fault.wait()
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return decode(*args, **kwargs)

    vocoder._run, runner.decode = stuck_round, faulty_decode
    admitted, on_admit = [], engine._sched._on_admit
    engine._sched._on_admit = lambda req: (admitted.append(req), on_admit(req))[-1]
    answered = {}

    def consume(stage: str, tokens: int) -> None:
        request = SynthesisRequest(text="Hello there, a test.", prompt_audio=prompt_wav(), prompt_text="a prompt",
                                   force_tokens=tokens)
        try:
            for _ in engine.stream(request):
                pass
            say(event="answer", stage=stage, code="completed")
        except CosyVoiceError as e:
            say(event="answer", stage=stage, code=engine_error(e).code, message=str(e))
        answered[stage].set()

    def start(stage: str, tokens: int) -> None:
        answered[stage] = threading.Event()
        threading.Thread(target=consume, args=(stage, tokens), daemon=True).start()

    sched = engine._sched
    start("vocoder", 40)
    assert vocoding.wait(60) and wait_until(lambda: len(admitted) == 1 and admitted[0].pieces[0].done
                                            and not sched.running, 60), "no request reached the audio stage"
    armed.set()
    start("running", 200)
    assert decoding.wait(60) and len(sched.running) == 1, "no request is decoding"
    start("waiting", 40)
    assert wait_until(lambda: len(sched.waiting) == 1, 60), "no request is waiting"
    say(event="stages", running=len(sched.running), waiting=len(sched.waiting), audio=len(vocoder.requests()))
    fault.set()
    assert wait_until(lambda: engine.fatal_error is not None, 60), "the fault did not kill the engine"
    say(event="ready_after", status=client.get("/health/ready").status_code)
    for done in answered.values():
        done.wait(NO_EXIT_S)
    threading.Event().wait(NO_EXIT_S)  # the engine's exit comes here
    say(event="no_exit")
    os._exit(0)


if __name__ == "__main__":
    main()
