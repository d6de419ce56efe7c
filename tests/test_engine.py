"""Engine behaviour on the tiny random model (CPU): streaming vs one-shot audio, batching invariance, cancel,
memory, modes, input errors, NaN fallback, live settings."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time

import numpy as np
import psutil
import pytest
import soundfile as sf
import torch

from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.engine import engine as engine_module
from cosyvoice_opt.engine import scheduler as scheduler_module
from cosyvoice_opt.engine.llm_runner import LLMRunner
from cosyvoice_opt.engine.scheduler import FlowPrompt, Request, Scheduler, TextPiece
from cosyvoice_opt.errors import CosyVoiceError, InputError
from cosyvoice_opt.models.hift import HiFT
from cosyvoice_opt.random_model import random_model
from cosyvoice_opt.types import Mode, SynthesisRequest
from tests.conftest import REPO_ROOT, wait_until
from tests.tolerances import BATCH, assert_close

SR = 16000
FRAME = 480  # output samples per mel frame


def prompt_wav(seconds: float = 3.3) -> tuple[int, np.ndarray]:
    t = np.arange(int(SR * seconds)) / SR
    return SR, (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def request(**kw) -> SynthesisRequest:
    base = {"text": "Hello world, this is a test.", "prompt_audio": prompt_wav(), "prompt_text": "a prompt text",
            "seed": 3}
    return SynthesisRequest(**{**base, **kw})


def quiet_source_model(device):
    """The tiny model with HiFT's random excitation switched off (nsf_alpha = nsf_sigma = 0): the source is then a
    constant, so streaming and one-shot HiFT see identical excitation and differ only where chunking does."""
    m = random_model("tiny", 0, device)
    hift = HiFT(dataclasses.replace(m.hift.cfg, nsf_alpha=0.0, nsf_sigma=0.0)).to(device)
    hift.load_state_dict(m.hift.state_dict())
    m.hift = hift.eval()
    return m


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = Engine(quiet_source_model, EngineConfig(random_size="tiny", device="cpu",
                                                voices_dir=str(tmp_path_factory.mktemp("voices"))))
    yield e
    e.close()


def speech_tokens_of(engine: Engine, run):
    """`run()`'s result and the speech tokens the LLM made for the one request it sends (one list per text piece)."""
    admitted, on_admit = [], engine._sched._on_admit
    engine._sched._on_admit = lambda req: (admitted.append(req), on_admit(req))[-1]
    try:
        out = run()
    finally:
        engine._sched._on_admit = on_admit
    assert len(admitted) == 1
    return out, [list(piece.tokens) for piece in admitted[0].pieces]


def test_streaming_and_one_shot_cover_the_same_tokens(engine):
    """A streamed request arrives in several chunks, indexed in order, the last one marked; the same request as a
    whole clip is one chunk of the same length, made from the very same speech tokens (same seed, same sampling).
    Their samples differ by design: a whole clip runs upstream's non-streaming flow (full attention over every token,
    tests/test_streaming.py), a stream the block-causal one chunk by chunk (its chunks equal upstream's streaming
    ones, tests/test_streaming.py and tests/test_flow.py)."""
    req = request(force_tokens=300)
    chunks, streamed = speech_tokens_of(engine, lambda: list(engine.stream(req)))
    one, whole = speech_tokens_of(engine, lambda: engine.synthesize(req))
    assert len(chunks) >= 4 and chunks[-1].is_last and not any(c.is_last for c in chunks[:-1])
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert one.is_last and one.index == 0
    assert sum(len(c.pcm) for c in chunks) == len(one.pcm) == 300 * 2 * FRAME
    assert streamed == whole and sum(map(len, whole)) == 300 == chunks[-1].tokens == one.tokens
    _, reseeded = speech_tokens_of(engine, lambda: engine.synthesize(dataclasses.replace(req, seed=req.seed + 1)))
    assert reseeded != whole  # the tokens depend on the seed: the equality above is not a given


def _run_llm(llm, reqs, max_batch, runner=None):
    """Drive Scheduler + LLMRunner (default: CPU, eager) directly; requests join at different steps."""
    runner = runner or LLMRunner(llm, 4, 256, torch.float32, torch.device("cpu"), cuda_graphs=False)
    sched = Scheduler(max_batch, llm.cfg.stop_token_ids)
    pending = list(reqs)
    step = 0
    while pending or sched.running:
        if pending and step % 3 == 0:
            sched.submit(pending.pop(0))
        sched.step(runner)
        step += 1
    return [[list(p.tokens) for p in r.pieces] for r in reqs]


def _llm_request(llm, seed, n_text, force=None, pieces=1):
    ps = []
    for k in range(pieces):
        ids = torch.arange(5 + k, 5 + k + n_text)
        lo, hi = llm.length_bounds(n_text)
        ps.append(TextPiece(ids, torch.arange(7), lo, force or hi))
    empty = FlowPrompt(torch.zeros(1, 0), torch.zeros(1, 0, 80), torch.zeros(1, 192))
    return Request(ps, empty, stream=True, speed=1.0, seed=seed, force_tokens=force, arrival=0.0, frontend_s=0.0)


@torch.inference_mode()
def test_decode_runs_one_step_ahead_of_the_host():
    """A step queues the next decode before reading the previous one's tokens: a newcomer's tokens arrive one call
    later, two at once (its first, sampled at prefill, and its first decoded one); the row decoded after its last
    token is dropped, and the slot is free as soon as that last token is read."""
    llm = random_model("tiny", 0).llm
    runner = LLMRunner(llm, 2, 256, torch.float32, torch.device("cpu"), cuda_graphs=False)
    sched = Scheduler(2, llm.cfg.stop_token_ids)
    req = _llm_request(llm, 5, 3, force=4)
    sched.submit(req)
    assert sched.step(runner) == [] and req.piece.tokens == [] and req.kv_len == req.piece.prefix_len + 1
    assert sched.step(runner) == [req] and len(req.piece.tokens) == 2
    sched.step(runner)
    assert len(req.piece.tokens) == 3 and sched.running == [req]
    sched.step(runner)  # delivers the 4th (last) token; the step queued meanwhile decoded a 5th row, dropped
    assert len(req.piece.tokens) == 4 and req.piece.done and sched.running == [] and req.slot is None
    assert sched.step(runner) == [] and len(req.piece.tokens) == 4
    assert req.piece.tokens == _run_llm(llm, [_llm_request(llm, 5, 3, force=4)], 1)[0][0]


class _WaitSpy(threading.Condition):
    """A scheduler's condition that records the timeout of every `wait_for` (a hold) and sets `waiting` as one
    begins, so a test sees a hold start and end without timing it."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []
        self.waiting = threading.Event()

    def wait_for(self, predicate, timeout=None):
        self.timeouts.append(timeout)
        self.waiting.set()
        return super().wait_for(predicate, timeout)


@torch.inference_mode()
def test_decode_holds_while_a_lone_request_waits_for_its_first_audio(monkeypatch):
    """When the vocoder is making the first audio of the only running request, a step queues no decode and waits (until
    the vocoder pokes, a newcomer arrives or `HOLD_S` passes); the tokens are the same as without holding. With two
    running requests there is no hold."""
    llm = random_model("tiny", 0).llm
    runner = LLMRunner(llm, 2, 256, torch.float32, torch.device("cpu"), cuda_graphs=False)
    sched = Scheduler(2, llm.cfg.stop_token_ids)
    sched._cond = spy = _WaitSpy()
    req = _llm_request(llm, 5, 3, force=6)
    sched.submit(req)
    sched.step(runner)
    sched.step(runner)
    assert len(req.piece.tokens) == 2 and spy.timeouts == []
    req.first_audio_busy = True
    monkeypatch.setattr(scheduler_module, "HOLD_S", 0.0)  # a hold that has run its course
    sched.step(runner)  # delivers the step queued before, queues none, holds for HOLD_S
    assert spy.timeouts == [0.0] and len(req.piece.tokens) == 3 and sched._inflight is None

    monkeypatch.setattr(scheduler_module, "HOLD_S", 3600.0)  # only the vocoder's poke can end this hold
    spy.waiting.clear()

    def step() -> None:
        with torch.inference_mode():
            sched.step(runner)

    holding = threading.Thread(target=step)
    holding.start()
    assert spy.waiting.wait(60) and holding.is_alive()  # holding, not returned
    req.first_audio_busy = False  # the vocoder's first audio is out: it clears the flag and pokes
    sched.poke()
    holding.join(60)
    assert not holding.is_alive() and spy.timeouts == [0.0, 3600.0]
    assert len(req.piece.tokens) == 3 and sched._inflight is None

    monkeypatch.setattr(scheduler_module, "HOLD_S", 0.0)  # were there a hold below, it would not hang the test
    other = _llm_request(llm, 6, 3, force=6)
    sched.submit(other)
    sched.step(runner)  # prefills `other` (with a decode step for both)
    req.first_audio_busy = True
    sched.step(runner)
    assert len(spy.timeouts) == 2 and sched._inflight is not None  # no hold: a decode step queued at once
    req.first_audio_busy = False
    while sched.running:
        sched.step(runner)
    assert req.piece.tokens == _run_llm(llm, [_llm_request(llm, 5, 3, force=6)], 1)[0][0]
    assert other.piece.tokens == _run_llm(llm, [_llm_request(llm, 6, 3, force=6)], 1)[0][0]


@torch.inference_mode()
def test_batched_tokens_equal_unbatched():
    llm = random_model("tiny", 0).llm
    specs = [(11, 3, None, 1), (12, 4, 17, 2), (13, 2, None, 1), (14, 5, 9, 1)]
    alone = [_run_llm(llm, [_llm_request(llm, *s)], 1)[0] for s in specs]
    together = _run_llm(llm, [_llm_request(llm, *s) for s in specs], 4)
    assert together == alone
    assert len(alone[1]) == 2 and all(len(p) == 17 for p in alone[1])  # forced: exactly N tokens per piece
    assert len(alone[3][0]) == 9
    assert len({tuple(r[0]) for r in alone}) == len(alone)  # different seeds give different tokens


class LLMGraphUse:
    """What a CUDA-graph `LLMRunner` runs from here on: replays of its captured decode and extend graphs, and decode
    steps run eagerly (a shape without a graph). A capture or compile that fails falls back to eager with the right
    tokens, so a test of the graph path asserts these counts as well as the tokens. Every (batch, attention length)
    bucket must have its graphs."""

    def __init__(self, runner: LLMRunner) -> None:
        buckets = len(runner.batch_buckets) * len(runner.kv_buckets)
        assert len(runner._graphs) == len(runner._extend_graphs) == buckets > 0, "a graph was not captured"
        self.decode_calls = self.decode_replays = self.extend_replays = self.eager_steps = 0
        for graph, _ in runner._graphs.values():
            self._count(graph, "decode_replays")
        for graph, _ in runner._extend_graphs.values():
            self._count(graph, "extend_replays")
        step, decode = runner._step, runner.decode

        def eager(*args):
            self.eager_steps += 1
            return step(*args)

        def decoding(*args, **kwargs):
            self.decode_calls += 1
            return decode(*args, **kwargs)

        runner._step, runner.decode = eager, decoding

    def all_decodes_replayed(self) -> bool:
        return self.decode_replays == self.decode_calls > 0 and self.eager_steps == 0

    def _count(self, graph: torch.cuda.CUDAGraph, counter: str) -> None:
        replay = graph.replay

        def counted() -> None:
            setattr(self, counter, getattr(self, counter) + 1)
            replay()

        graph.replay = counted


@pytest.mark.gpu  # CUDA graphs and torch.compile of the decode step
@torch.inference_mode()
def test_compiled_graph_decode_equals_eager(monkeypatch):
    """The compiled, graph-captured decode step gives the tokens the plain eager step gives (fp32, TF32 off), and
    every step is a replay of a captured graph of the compiled step."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    llm = random_model("tiny", 0).llm.cuda()
    llm.backbone.fuse_projections_()
    specs = [(11, 3, None, 1), (12, 4, 17, 2), (13, 2, None, 1), (14, 5, 9, 1)]
    cuda = torch.device("cuda")
    eager, graphed = (LLMRunner(llm, 4, 256, torch.float32, cuda, cuda_graphs=graphs, compile=graphs)
                      for graphs in (False, True))
    assert graphed._step != graphed._decode_rows, "torch.compile failed: the graphs hold the uncompiled step"
    use = LLMGraphUse(graphed)
    runs = [_run_llm(llm, [_llm_request(llm, *s) for s in specs], 4, runner) for runner in (eager, graphed)]
    assert runs[0] == runs[1]
    assert sum(len(p) for r in runs[0] for p in r) > 40
    assert use.all_decodes_replayed(), vars(use)


@torch.inference_mode()
def test_a_prefix_fed_as_a_padded_extend_of_its_empty_slot_is_its_prefill():
    """What the graphed prefill runs (`LLMRunner._prefill_one`): one prefix as an extend at position 0, its row
    padded to the bucket by repeating its last input, gives the prefill's log-probs and writes the prefill's keys and
    values (the padding writes the last position's again, nothing beyond it)."""
    llm = random_model("tiny", 0).llm
    runner = LLMRunner(llm, 2, 256, torch.float32, torch.device("cpu"), cuda_graphs=False)
    x = _llm_request(llm, 5, 9).piece.prefix(llm, torch.device("cpu"))
    n = x.shape[1]
    expected = llm.prefill(x, runner.cache, [1], [n])
    kv = runner.cache.data[:, :, 1, :n].clone()
    runner.cache.data.zero_()
    padded, index = llm.padded_rows([x], [1], [0], 64, 1)
    positions, slots = index[:64].view(1, 64), index[64:]
    got = llm.log_probs(llm.backbone.extend_rows(padded, runner.cache, slots, positions, 64)[:, -1])
    assert_close(got, expected, BATCH)
    assert_close(runner.cache.data[:, :, 1, :n], kv, BATCH)
    assert not runner.cache.data[:, :, 1, n:].any() and not runner.cache.data[:, :, 0].any()


@pytest.mark.gpu  # CUDA graphs
@torch.inference_mode()
def test_a_lone_newcomers_prefill_replays_a_captured_forward(monkeypatch):
    """On CUDA, each lone newcomer's prefix runs as a replay of its length bucket's prefill graph, and the tokens are
    the eager prefill's (fp32, TF32 off)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    llm = random_model("tiny", 0).llm.cuda()
    specs = [(11, 3, None, 1), (12, 40, 17, 2), (13, 2, None, 1), (14, 90, 9, 1)]
    graphed, eager = (LLMRunner(llm, 4, 256, torch.float32, torch.device("cuda"), cuda_graphs=g)
                      for g in (True, False))
    assert sorted(graphed._prefill_graphs) == graphed.prefill_buckets == [64, 128, 192, 256]
    replays = []
    for t, (graph, _) in graphed._prefill_graphs.items():
        replay = graph.replay
        graph.replay = lambda t=t, replay=replay: (replays.append(t), replay())[-1]
    prefill = llm.prefill
    monkeypatch.setattr(llm, "prefill", lambda *a: pytest.fail("an eager prefill ran on the graphed runner"))
    got = _run_llm(llm, [_llm_request(llm, *s) for s in specs], 4, graphed)
    monkeypatch.setattr(llm, "prefill", prefill)
    assert got == _run_llm(llm, [_llm_request(llm, *s) for s in specs], 4, eager)
    assert sum(len(p) for r in got for p in r) > 40
    assert len(replays) == 5 and 128 in replays  # 4 requests, one of 2 pieces; the 90-word text needs a longer bucket


@torch.inference_mode()
def test_decode_step_traces_as_one_graph():
    """`--compile` traces the whole decode step as one graph. A graph break splits it into dozens of pieces (a
    data_ptr() check in the fused projections did: two per layer), each compiled again for every batch size."""
    llm = random_model("tiny", 0).llm
    llm.backbone.fuse_projections_()
    runner = LLMRunner(llm, 4, 256, torch.float32, torch.device("cpu"), cuda_graphs=False)
    runner._n_live.fill_(2)
    explained = torch._dynamo.explain(runner._decode_rows)(2, 256)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@torch.inference_mode()
def test_failed_compile_falls_back_to_the_plain_step(caplog):
    """A compiler failure at warm-up (no Triton, no C compiler) is logged and decoding goes on uncompiled."""
    llm = random_model("tiny", 0).llm
    runner = LLMRunner(llm, 2, 64, torch.float32, torch.device("cpu"), cuda_graphs=False)

    def broken(b, s):
        raise RuntimeError("no C compiler")

    runner._step = broken
    runner._n_live.fill_(2)
    with caplog.at_level("WARNING"):
        runner._warm_step(2, 64)
    assert runner._step == runner._decode_rows
    assert "decoding uncompiled" in caplog.text and "no C compiler" in caplog.text
    assert runner.decode(2, 64).shape == (2,)


def test_concurrent_requests_share_flow_batches_and_sound_as_alone(engine):
    """Ready chunks of concurrent requests go through one batched flow call (and batched HiFT); each request's
    audio is still what it is alone (same seeds; rows are padded and masked, so only rounding differs)."""
    reqs = [request(force_tokens=n, seed=s) for n, s in ((60, 1), (90, 2), (75, 3))]
    alone = [np.concatenate([c.pcm for c in engine.stream(r)]) for r in reqs]
    flow, rows = engine._parts.vocoder.flow, []
    real = flow.finish_chunks  # the end of every flow call, paged or eager

    def counting(batch, feat):
        rows.append(len(batch.states))
        return real(batch, feat)

    flow.finish_chunks = counting
    try:
        its = [engine.stream(r) for r in reqs]  # all three are running before any audio is read
        together = [np.concatenate([c.pcm for c in it]) for it in its]
    finally:
        del flow.finish_chunks
    assert max(rows) > 1
    for a, b in zip(alone, together, strict=True):
        assert a.shape == b.shape and np.abs(a.astype(np.int32) - b).max() <= 64


def test_prompt_quality_warnings_come_with_the_first_chunk(engine):
    """A clipped prompt is accepted (as upstream) but said to be clipped, also when its features come from the
    cache; a clean recording gets no warning."""
    speech, rate = sf.read(REPO_ROOT / "assets" / "en_male.wav", dtype="float32")
    assert engine.synthesize(request(prompt_audio=(rate, speech), force_tokens=10)).warnings == ()
    clipped = (rate, np.clip(speech * 20, -1, 1))
    for _ in range(2):  # computed, then a cache hit
        chunks = list(engine.stream(request(prompt_audio=clipped, force_tokens=60)))
        assert any("clipped" in w for w in chunks[0].warnings)
        assert all(c.warnings == () for c in chunks[1:])


def assert_pool_free(runner) -> None:
    """Once idle, only the cached prompt prefixes hold pages: without them every page and slot is free."""
    runner.evict_prefixes()
    pool = runner.pool
    assert len(pool.free_pages) == pool.num_pages and len(pool.free_slots) == pool.num_slots - runner.max_prefixes


def test_cancel_frees_slot(engine):
    it = engine.stream(request(force_tokens=600))
    first = next(it)
    assert first.index == 0 and not first.is_last
    assert engine.stats()["running"] == 1
    it.close()
    assert wait_until(lambda: engine.stats()["running"] == 0 and engine._parts.vocoder.idle())
    assert_pool_free(engine._parts.vocoder.flow_runner)
    assert engine.synthesize(request(force_tokens=20)).is_last  # the engine still serves


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gc.get_objects() touches deprecated torch aliases
def test_memory_steady_over_many_requests(engine):
    """220 requests; between request 120 and 220 neither live tensors nor RSS may grow (one-off lazy allocations
    happen earlier; a leak of even one tensor per request would add 100)."""
    req = request(force_tokens=6, stream=False)

    def live_tensors() -> int:
        time.sleep(0.2)
        gc.collect()
        return sum(1 for o in gc.get_objects() if torch.is_tensor(o))

    def measure(n: int) -> tuple[int, int]:
        for _ in range(n):
            engine.synthesize(req)
        assert wait_until(engine._parts.vocoder.idle)
        # the worker threads drop the last request's state just after delivering it: a leak stays in every sample
        return min(live_tensors() for _ in range(3)), psutil.Process().memory_info().rss

    measure(120)
    tensors0, rss0 = measure(1)
    tensors1, rss1 = measure(100)
    assert tensors1 - tensors0 <= 95
    assert rss1 - rss0 < 32 << 20  # allocator noise only
    assert engine.stats()["running"] == 0


def test_all_modes_produce_audio(engine):
    engine.save_voice("spk1", prompt_wav(), "a prompt text")
    assert "spk1" in engine.list_voices()
    cases = [
        request(mode=Mode.ZERO_SHOT),
        request(mode=Mode.CROSS_LINGUAL, prompt_text=""),
        request(mode=Mode.INSTRUCT2, instruct_text="Speak happily."),
        SynthesisRequest(text="Hello there.", mode=Mode.SFT, voice="spk1"),
        SynthesisRequest(text="Hello there.", mode=Mode.ZERO_SHOT, voice="spk1"),
    ]
    for r in cases:
        out = engine.synthesize(dataclasses.replace(r, max_tokens=40))
        assert out.pcm.dtype == np.int16 and len(out.pcm) > 0 and out.sample_rate == 24000
        assert np.abs(out.pcm).max() > 0
    engine.delete_voice("spk1")
    assert "spk1" not in engine.list_voices()


def test_prepare_hands_over_host_tensors(engine, monkeypatch):
    """The caller's thread does no device work: `_prepare` hands over CPU tensors (prefix ids, flow prompt), and each
    piece's `prefix_len`, which the length check uses, is the length of the prefix the engine thread embeds."""
    llm, text = engine._parts.model.llm, "First sentence here. " * 12 + "And a second one."
    cases = {mode: request(mode=mode, text=text, force_tokens=10, **kw)
             for mode, kw in ((Mode.ZERO_SHOT, {}), (Mode.CROSS_LINGUAL, {"prompt_text": ""}))}
    for mode, r in cases.items():
        req = engine._prepare(r)
        assert len(req.pieces) > 1
        req.prompt.resolve()  # a new voice's x-vector may still be in the making
        assert all(t.device.type == "cpu" for t in dataclasses.astuple(req.prompt))
        for piece in req.pieces:
            assert piece.text_ids.device.type == "cpu"
            if mode == Mode.ZERO_SHOT:
                assert req.prompt.tokens.shape[1] > 0 and torch.equal(piece.prompt_speech, req.prompt.tokens[0])
            else:
                assert piece.prompt_speech is None
            with torch.inference_mode():
                assert piece.prefix(llm, engine.device).shape[1] == piece.prefix_len
        # a piece needs its prefix, the position of its first token and max(min_len, forced tokens) more
        need = max(p.prefix_len + 1 + max(p.min_len, 10) for p in req.pieces)
        with monkeypatch.context() as m:
            m.setitem(engine_module.MAX_SEQ, "cpu", need)
            assert [p.max_len for p in engine._prepare(r).pieces] == [10] * len(req.pieces)
            m.setitem(engine_module.MAX_SEQ, "cpu", need - 1)
            with pytest.raises(InputError, match="too long"):
                engine._prepare(r)


@pytest.mark.parametrize("bad", [
    {"text": ""},
    {"text": "!!! ..."},
    {"speed": 3.0, "stream": False},
    {"speed": 1.5, "stream": True},
    {"prompt_audio": None},
    {"prompt_text": ""},
    {"mode": "nonsense"},
    {"mode": Mode.SFT, "prompt_audio": None},
    {"voice": "no-such-voice"},
    {"force_tokens": 0},
    {"prompt_audio": (SR, np.zeros(10, np.float32))},
])
def test_bad_input_raises_before_any_chunk(engine, bad):
    done = engine.stats()["completed"]
    with pytest.raises(InputError):
        engine.stream(request(**bad))
    assert engine.stats()["waiting"] == 0 and engine.stats()["completed"] == done


def test_chunk_timings_and_speed(engine):
    chunks = list(engine.stream(request(force_tokens=100)))
    t = chunks[-1].timings
    assert t.llm > 0 and t.flow > 0 and t.hift > 0 and t.since_arrival >= chunks[0].timings.since_arrival
    assert chunks[-1].tokens == 100
    slow = engine.synthesize(request(force_tokens=100, speed=0.5))
    assert len(slow.pcm) == 2 * 100 * 2 * FRAME


def test_nan_chunk_falls_back_to_fp32(tmp_path):
    with Engine(lambda d: random_model("tiny", 0, d),
                EngineConfig(random_size="tiny", device="cpu", precision="bf16", voices_dir=str(tmp_path))) as e:
        voc = e._parts.vocoder
        voc._fp32_flow()  # a clean fp32 copy, made before the patch below
        flow, calls = voc.flow, []
        real = flow.finish_chunks

        def poisoned(*args, **kw):
            out = real(*args, **kw)
            if not any(mel.numel() for mel in out):  # a prompt prefix: no audio frames
                return out
            calls.append(1)
            return [mel * float("nan") for mel in out] if len(calls) == 1 else out

        flow.finish_chunks = poisoned
        chunks = list(e.stream(request(force_tokens=80)))
        assert e.stats()["fp32_fallbacks"] == 1 and voc.flow_runner.pool.free_slots
        # the poisoned chunk is recomputed, not dropped: every token's frames are there
        assert chunks[-1].is_last and sum(len(c.pcm) for c in chunks) == 80 * 2 * FRAME


def test_a_full_flow_pool_queues_requests_instead_of_spilling(engine, tmp_path, monkeypatch, caplog):
    """With room for 10 flow pages (the longest piece of a 256-position cache), two requests that reserve 8 and 6
    pages (82 prompt tokens + 120 / 70 at most) cannot run together: the second waits in the queue until the first
    has made its last audio, then runs on the paged path too. No stream leaves the paged path, both sound as with
    room to spare, and every reservation, page and slot comes back."""
    monkeypatch.setattr(engine_module, "FLOW_PAGES_PER_STREAM", 3)
    monkeypatch.setattr(engine_module, "MAX_SEQ", {"cpu": 256})
    reqs = [request(force_tokens=n, seed=s) for n, s in ((120, 1), (70, 2))]
    roomy = [np.concatenate([c.pcm for c in engine.stream(r)]) for r in reqs]
    with Engine(quiet_source_model, EngineConfig(random_size="tiny", device="cpu", max_batch_size=2,
                                                 max_queue_wait=600, voices_dir=str(tmp_path))) as e:
        pool = e._parts.vocoder.flow_runner.pool
        assert pool.num_pages == 10
        events = []
        voc, sched = e._parts.vocoder, e._sched
        admit, release = voc.add, sched.release
        monkeypatch.setattr(voc, "add", lambda req: (events.append(("admit", req.pages)), admit(req)))
        monkeypatch.setattr(sched, "release", lambda req: (events.append(("release", req.pages)), release(req)))
        its = [e.stream(r) for r in reqs]
        tight = [np.concatenate([c.pcm for c in it]) for it in its]
        assert wait_until(lambda: e._parts.vocoder.idle())
        assert events == [("admit", 8), ("release", 8), ("admit", 6), ("release", 6)]
        assert "page pool is full" not in caplog.text
        assert e.stats()["pages_reserved"] == 0 and e.stats()["streams"] == 0
        assert_pool_free(e._parts.vocoder.flow_runner)
    for a, b in zip(roomy, tight, strict=True):
        assert a.shape == b.shape and np.abs(a.astype(np.int32) - b).max() <= 64


def test_repeated_prompt_reuses_its_flow_prefix(engine):
    """The second streamed request with the same long prompt (one that does not fit one flow call with its first
    chunk) starts from the first one's cached prefix, with the same audio."""
    wav = prompt_wav(6.1)  # a prompt no other test uses
    before = engine.stats()["flow_prefix_hits"]
    first, again = (np.concatenate([c.pcm for c in engine.stream(request(prompt_audio=wav, force_tokens=40, seed=9))])
                    for _ in range(2))
    assert engine.stats()["flow_prefix_hits"] == before + 1
    assert first.shape == again.shape and np.abs(first.astype(np.int32) - again).max() <= 64
    stats = engine.stats()
    assert 0 < stats["flow_pages_used"] <= stats["flow_pages"]  # the cached prefixes hold their pages


def _hold_the_speaker_encoder(engine, monkeypatch, fail: bool = False) -> threading.Event:
    """The engine's speaker encoder waits until the returned event is set (then fails, with `fail`)."""
    release, inner = threading.Event(), engine.speaker_encoder

    def held(fbank):
        assert release.wait(timeout=120), "the test never released the speaker encoder"
        if fail:
            raise RuntimeError("planted failure")
        return inner(fbank)

    monkeypatch.setattr(engine, "speaker_encoder", held)
    return release


def _stream_in_a_thread(engine, r: SynthesisRequest):
    """(set once `engine.stream(r)` has returned its iterator, [the iterator])."""
    returned, box = threading.Event(), []
    threading.Thread(target=lambda: (box.append(engine.stream(r)), returned.set()), daemon=True).start()
    return returned, box


def test_a_new_voice_decodes_while_its_speaker_embedding_is_made(engine, monkeypatch, model_work):
    """The LLM needs only a prompt's speech tokens: a new voice's request is admitted and decodes all its tokens while
    the speaker encoder (which only the flow needs) still runs. Once made, the prompt's features are cached: the same
    voice again runs neither network, and its audio is the same (same seed)."""
    inner = engine.speaker_encoder
    release = _hold_the_speaker_encoder(engine, monkeypatch)
    admitted, on_admit = [], engine._sched._on_admit
    monkeypatch.setattr(engine._sched, "_on_admit", lambda req: (admitted.append(req), on_admit(req))[-1])
    r = request(prompt_audio=prompt_wav(3.7), force_tokens=60, seed=5)  # a prompt no other test uses
    try:
        returned, box = _stream_in_a_thread(engine, r)
        assert returned.wait(timeout=120), "the request waited for the speaker embedding before it was queued"
        assert wait_until(lambda: admitted and admitted[0].pieces[0].done, timeout=120)
        assert len(admitted[0].pieces[0].tokens) == 60 and not admitted[0].prompt.ready()
    finally:
        release.set()
    early = np.concatenate([c.pcm for c in box[0]])
    monkeypatch.setattr(engine, "speaker_encoder", inner)
    cached = np.concatenate([c.pcm for c in engine.stream(r)])
    assert model_work == {"features": 1, "queued": 2}
    assert early.shape == cached.shape and np.abs(early.astype(np.int32) - cached).max() <= 64


def test_a_failed_speaker_embedding_fails_its_request_alone(engine, monkeypatch):
    """A speaker encoder that fails on a new voice fails that request (after it was queued) with an error that says
    so; its reservation comes back and the engine serves the next request."""
    failed = engine.stats()["failed"]
    release = _hold_the_speaker_encoder(engine, monkeypatch, fail=True)
    returned, box = _stream_in_a_thread(engine, request(prompt_audio=prompt_wav(3.9), force_tokens=40))
    try:
        assert returned.wait(timeout=120)
    finally:
        release.set()
    with pytest.raises(CosyVoiceError, match="prompt audio's features failed"):
        list(box[0])
    monkeypatch.undo()
    assert engine.synthesize(request(force_tokens=20)).is_last
    assert wait_until(lambda: engine._parts.vocoder.idle() and engine.stats()["running"] == 0)
    assert engine.stats()["failed"] == failed + 1
    assert_pool_free(engine._parts.vocoder.flow_runner)


def test_flow_pool_fits_in_free_memory(engine, monkeypatch):
    """The page pool never asks for more than its share of the free memory (on CPU: the host's), however many
    streams are wanted; it never shrinks below what it has."""
    parts = engine._parts
    per_page = engine_module.FlowRunner.bytes_per_page(parts.model.flow, parts.policy.flow)
    free = 10 * per_page / engine_module.FLOW_MEMORY_FRACTION
    monkeypatch.setattr(engine_module.psutil, "virtual_memory", lambda: type("Mem", (), {"available": free})())
    assert engine._flow_room(64, 0, parts.model, parts.policy) == (10, 128)
    assert engine._flow_room(64, 4, parts.model, parts.policy) == (14, 128)
    assert engine._flow_room(1, 40, parts.model, parts.policy) == (40, 2)


def test_live_settings(tmp_path):
    with Engine(lambda d: random_model("tiny", 0, d),
                EngineConfig(random_size="tiny", device="cpu", max_batch_size=1, voices_dir=str(tmp_path))) as e:
        assert e.info["max_batch_size"] == 1 and e._parts.runner.num_slots == 1
        e.set_max_batch_size(3)
        outs = []
        its = [e.stream(request(force_tokens=40, seed=s)) for s in range(3)]
        for it in its:
            outs.append(np.concatenate([c.pcm for c in it]))
        assert e._parts.runner.num_slots == 3 and all(len(o) == 40 * 2 * FRAME for o in outs)
        before = e.synthesize(request(force_tokens=30))
        counted = e.stats()
        e.set_precision("bf16")
        assert e.info["precision"] == "bf16"
        after = e.synthesize(request(force_tokens=30))
        rebuilt = e.stats()  # the vocoder was rebuilt: its counters go on from where they were
        assert all(rebuilt[k] >= counted[k] for k in ("vocoder_rounds", "vocoder_chunks", "vocoder_busy_seconds",
                                                         "flow_calls", "flow_rows", "llm_steps"))
        assert rebuilt["vocoder_chunks"] > counted["vocoder_chunks"]
        assert len(before.pcm) == len(after.pcm)
        with pytest.raises(InputError):
            e.set_precision("fp8")
        assert e.info["precision"] == "bf16"


@torch.inference_mode()
def test_prefill_many_equals_prefilling_one_at_a_time(monkeypatch):
    """Newcomers prefilled in one packed call (into slots in shuffled order), or in several calls when they exceed
    the token cap, get the same first tokens, state rows and KV entries as prefilled one by one, and then decode
    the same next tokens."""
    from cosyvoice_opt.engine import llm_runner

    llm = random_model("tiny", 0).llm
    llm.backbone.fuse_projections_()
    reqs = [_llm_request(llm, seed, n_text, force) for seed, n_text, force in ((11, 3, None), (12, 9, 5),
                                                                              (13, 1, None), (14, 6, None))]
    args = ([2, 0, 3, 1], [r.piece.prefix(llm, torch.device("cpu")) for r in reqs], [r.piece_seed for r in reqs],
            [r.piece.min_len for r in reqs], [r.force_tokens is not None for r in reqs])
    lengths = [x.shape[1] for x in args[1]]

    def run(groups: list[list[int]] | None, cap: int) -> tuple[list[int], LLMRunner]:
        monkeypatch.setattr(llm_runner, "PREFILL_TOKENS", cap)
        runner = LLMRunner(llm, 4, 64, torch.float32, torch.device("cpu"), cuda_graphs=False)
        runner.cache.data.normal_()
        if groups is None:
            firsts = runner.prefill_many(*args)
        else:
            firsts = torch.cat([runner.prefill_many(*([a[i] for i in g] for a in args)) for g in groups])
        return firsts.tolist() + runner.decode(4, max(lengths) + 1).tolist(), runner

    alone, ref = run([[0], [1], [2], [3]], llm_runner.PREFILL_TOKENS)
    for cap in (llm_runner.PREFILL_TOKENS, lengths[0] + lengths[1]):  # one packed call; then [0, 1], [2, 3]
        assert llm_runner._pack(lengths, cap) == ([[0, 1, 2, 3]] if cap > sum(lengths) else [[0, 1], [2, 3]])
        tokens, runner = run(None, cap)
        assert tokens == alone
        assert torch.equal(runner.state, ref.state)
        for slot, length in zip(args[0], lengths, strict=True):  # what decode wrote after the prefix too
            assert_close(runner.cache.data[:, :, slot, :, :length + 1], ref.cache.data[:, :, slot, :, :length + 1],
                         BATCH)


@torch.inference_mode()
def test_requests_admitted_in_one_step_decode_as_alone():
    """All requests waiting before the first step are prefilled together (one packed call) and still produce the
    tokens each produces alone, including a second text piece prefilled while others decode."""
    llm = random_model("tiny", 0).llm
    llm.backbone.fuse_projections_()
    specs = [(21, 3, None, 1), (22, 7, 12, 2), (23, 2, None, 1), (24, 5, 8, 1)]
    alone = [_run_llm(llm, [_llm_request(llm, *s)], 1)[0] for s in specs]
    runner = LLMRunner(llm, 4, 256, torch.float32, torch.device("cpu"), cuda_graphs=False)
    sched = Scheduler(4, llm.cfg.stop_token_ids)
    reqs = [_llm_request(llm, *s) for s in specs]
    for r in reqs:
        sched.submit(r)
    calls, real = [], runner.prefill_many

    def counting(slots, *rest):
        calls.append(len(slots))
        return real(slots, *rest)

    runner.prefill_many = counting
    while sched.running or sched.waiting:
        sched.step(runner)
    assert calls[0] == 4
    assert [[list(p.tokens) for p in r.pieces] for r in reqs] == alone


def _playback_job(stream: bool = True, arrival: float = 0.0, first_sent: float | None = None, sent_s: float = 0.0,
                  **tags):
    """A ready chunk of a request whose playback bookkeeping is as given (nothing else of it is set), plus `tags`."""
    from types import SimpleNamespace

    from cosyvoice_opt.engine.audio_worker import _RequestAudio

    voc = _RequestAudio.__new__(_RequestAudio)
    voc.req = SimpleNamespace(stream=stream, arrival=arrival)
    voc.first_sent, voc.sent_s = first_sent, sent_s
    return SimpleNamespace(voc=voc, **tags)


def test_most_urgent_chunks_go_first():
    """Waiting for the first audio beats playing (longest wait first); among listeners, the one with the least audio
    left to play goes first; whole-clip requests sit in between (slack 0)."""
    from cosyvoice_opt.engine.audio_worker import by_urgency

    def job(name, **playback):
        return _playback_job(name=name, **playback)

    now = 100.0
    jobs = [job("playing, 5 s left", first_sent=90.0, sent_s=15.0), job("new, waited 1 s", arrival=99.0),
            job("whole clip", stream=False), job("playing, 0.5 s left", first_sent=95.0, sent_s=5.5),
            job("new, waited 3 s", arrival=97.0), job("playing, ran dry 0.5 s ago", first_sent=90.0, sent_s=9.5)]
    assert [j.name for j in by_urgency(jobs, now)] == [
        "new, waited 3 s", "new, waited 1 s", "playing, ran dry 0.5 s ago", "whole clip", "playing, 0.5 s left",
        "playing, 5 s left"]


def test_a_small_round_is_one_flow_batch_and_a_large_one_puts_urgent_chunks_first():
    """A large round's first batch: first audio and listeners with less than `URGENT_SLACK_S` left (a young stream's
    second chunk); the listeners with audio in hand follow."""
    from cosyvoice_opt.engine.audio_worker import ONE_BATCH_ROWS, URGENT_SLACK_S, _batches, by_urgency

    now = 100.0

    def job(kind: int):  # 0: waiting for first audio; 1: less than URGENT_SLACK_S left; 2: audio in hand
        return _playback_job(kind=kind, arrival=99.0, first_sent=None if kind == 0 else now,
                             sent_s=0.0 if kind == 0 else URGENT_SLACK_S * (2 * kind - 1) / 2)

    small = [job(i % 3) for i in range(ONE_BATCH_ROWS)]
    assert _batches(small, 64, now) == [small] and _batches([], 64, now) == []
    large = by_urgency([job(i % 3) for i in range(ONE_BATCH_ROWS + 2)], now)  # 6 first, 6 urgent, 6 in hand
    batches = _batches(large, 64, now)
    assert [sorted({j.kind for j in b}) for b in batches] == [[0, 1], [2]] and [len(b) for b in batches] == [12, 6]
    assert [len(b) for b in _batches(large, 4, now)] == [4, 4, 4, 4, 2]


def test_a_round_takes_the_urgent_chunks_and_a_bounded_number_of_others():
    """First audio and listeners short of audio always go; of the listeners with audio in hand, the
    `ONE_BATCH_ROWS` closest to running out go and the rest wait for the next round while a round is bounded (a young
    stream exists); an unbounded round takes them all."""
    from cosyvoice_opt.engine.audio_worker import ONE_BATCH_ROWS, URGENT_SLACK_S, _round

    now = 100.0

    def job(slack: float | None):
        return _playback_job(arrival=99.0, first_sent=None if slack is None else now, sent_s=slack or 0.0)

    firsts = [job(None) for _ in range(3)]
    short = [job(URGENT_SLACK_S / 2), job(-1.0)]
    in_hand = [job(URGENT_SLACK_S + 0.1 * i) for i in range(ONE_BATCH_ROWS + 5)]
    taken = _round(in_hand[::-1] + short + firsts, now, bounded=True)
    assert {id(j) for j in taken} == {id(j) for j in firsts + short + in_hand[:ONE_BATCH_ROWS]}
    few = in_hand[:4] + firsts
    assert {id(j) for j in _round(few, now, bounded=True)} == {id(j) for j in few}
    everyone = _round(in_hand[::-1] + short, now, bounded=False)
    assert [id(j) for j in everyone] == [id(j) for j in short[::-1] + in_hand]  # least slack first


def test_while_streams_play_a_round_takes_one_whole_clip_the_longest_waiting():
    """A whole clip is one flow call over its whole piece: with streams playing, a round takes one (the earliest
    arrival) beside the streams' chunks, and the others wait for the rounds after; with no stream, a round takes
    them all."""
    from cosyvoice_opt.engine.audio_worker import WHOLE_CLIPS_PER_ROUND, _round

    now = 100.0
    clips = [_playback_job(stream=False, arrival=arrival) for arrival in (97.0, 95.0, 99.0)]
    playing = [_playback_job(arrival=90.0, first_sent=91.0, sent_s=9.5 + i) for i in range(3)]
    taken = _round(clips + playing, now, bounded=False, streams=True)
    assert WHOLE_CLIPS_PER_ROUND == 1
    assert {id(j) for j in taken} == {id(clips[1])} | {id(j) for j in playing}
    assert {id(j) for j in _round(clips[:1] + clips[2:], now, bounded=True, streams=True)} == {id(clips[0])}
    assert {id(j) for j in _round(clips, now, bounded=True, streams=False)} == {id(j) for j in clips}


def test_start_up_is_timed_by_part(engine):
    """Every part of the start-up is timed, and the parts that run one after the other fit in the time since the
    process started, as does the frontend, which loads beside the graph captures."""
    times = engine.info["startup_s"]
    serial = ("model", "llm", "flow_pool", "flow_hift_graphs", "warmup")
    assert set(times) == {*serial, "frontend", "process"} and all(times[k] >= 0 for k in (*serial, "frontend"))
    assert times["model"] > 0 and times["process"] >= sum(times[k] for k in serial)
    assert times["process"] >= times["frontend"] > 0


def test_a_frontend_that_fails_to_load_fails_the_engine_start(tmp_path, monkeypatch):
    """The frontend loads in a thread beside the graph captures: its error still reaches the caller of `Engine`."""
    import threading

    def broken(path):
        raise ValueError(f"not an ONNX model: {path}")

    monkeypatch.setattr(engine_module, "SpeakerEncoder", broken)
    with pytest.raises(ValueError, match="not an ONNX model"):
        Engine(quiet_source_model, EngineConfig(random_size="tiny", device="cpu", voices_dir=str(tmp_path)))
    assert not [t for t in threading.enumerate() if t.name.startswith("cosyvoice-frontend-load")]


def test_stage_counters_count_the_steps_rounds_and_flow_calls_of_a_request(engine):
    """One streamed request with a new voice: each of its tokens came from one LLM step's row (the first from its
    prefill), each chunk it received was made in a round, its chunks and prompt prefix went through paged flow calls."""
    before = engine.stats()
    chunks = list(engine.stream(request(force_tokens=90, seed=21, prompt_text="a prompt text never used before")))
    after = engine.stats()
    from cosyvoice_opt.engine.counters import STAGE_COUNTERS

    d = {k: after[k] - before[k] for k in STAGE_COUNTERS}
    assert d["llm_rows"] >= 89 and d["llm_steps"] >= 89 and d["llm_busy_seconds"] > 0
    assert d["vocoder_chunks"] >= len(chunks) > 1 and 1 <= d["vocoder_rounds"] <= d["vocoder_chunks"] + 1
    assert d["vocoder_busy_seconds"] > 0
    assert d["flow_calls"] >= len(chunks) - 1 and d["flow_rows"] >= d["flow_calls"]
