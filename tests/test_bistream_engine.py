"""Streamed text in the engine: continuous batching with other requests, parked rows, the idle limit, a client that
goes away, audio that starts before the text ends."""

from __future__ import annotations

import pytest
import torch

from cosyvoice_opt.engine import Engine, EngineConfig
from cosyvoice_opt.engine.bistream import BistreamFeed
from cosyvoice_opt.engine.llm_runner import LLMRunner
from cosyvoice_opt.engine.scheduler import FlowPrompt, Request, Scheduler, TextPiece
from cosyvoice_opt.errors import InputError
from cosyvoice_opt.models.bistream import BistreamPlan, bistream_calls, input_length
from cosyvoice_opt.models.llm import SpeechLLM
from cosyvoice_opt.models.sampling import push_history, ras_sample, sampling_uniforms
from cosyvoice_opt.random_model import random_model
from cosyvoice_opt.types import Mode, SynthesisRequest, TextStream
from tests.conftest import wait_until
from tests.test_engine import LLMGraphUse, _llm_request, assert_pool_free, prompt_wav, quiet_source_model

MAX_SEQ = 256


def _ids(text: str) -> list[int]:
    return [int(t) for t in text.split()]


class EngineSampler:
    """The engine's sampling for a streamed-text request, one row at a time: RAS with the row's counter uniforms
    (seed, index in `out`) and the last `win_size` of `out` as the window; every stop id masked in the text phase,
    and in the final phase any stop id ends the speech."""

    def __init__(self, llm, seed: int) -> None:
        self.cfg, self.seed = llm.cfg, seed

    def __call__(self, logp: torch.Tensor, out: list[int], text_phase: bool) -> int:
        cfg = self.cfg
        stops = torch.tensor(cfg.stop_token_ids)
        if text_phase:
            logp = logp.index_fill(0, stops, float("-inf"))
        history = torch.full((1, cfg.sampling.win_size), -1, dtype=torch.long)
        for tok in out:
            history = push_history(history, torch.tensor([tok]))
        u = sampling_uniforms(torch.tensor([self.seed]), torch.tensor([len(out)]))
        tok = int(ras_sample(logp[None], u, history, torch.tensor([False]), cfg.eos_token, cfg.sampling)[0])
        return cfg.eos_token if tok in cfg.stop_token_ids else tok


def _reference(llm, items: list[int], prompt_text: list[int], prompt_speech: list[int], seed: int) -> list[int]:
    """`bistream_calls` with the engine's sampler, cut where the engine's slot of MAX_SEQ positions ends."""
    tokens, final_calls, room = [], 0, None
    for call in bistream_calls(llm, [[i] for i in items], EngineSampler(llm, seed), prompt_text, prompt_speech):
        if call.phase == "final":
            if room is None:
                room = MAX_SEQ - (call.cache_len_before + call.lm_input.shape[1])
            final_calls += 1
            if final_calls > room:
                break
        if call.emitted:
            tokens.append(call.token)
    return tokens


def _streamed(llm, seed: int, prompt_text: list[int], prompt_speech: list[int],
              force: int | None = None) -> tuple[Request, TextStream]:
    source = TextStream()
    plan = BistreamPlan(llm.cfg, prompt_text, prompt_speech)
    speech = torch.tensor(prompt_speech) if prompt_speech else None
    piece = TextPiece(torch.tensor(prompt_text), speech, 0, MAX_SEQ)
    empty = FlowPrompt(torch.zeros(1, 0), torch.zeros(1, 0, 80), torch.zeros(1, 192))
    req = Request([piece], empty, stream=True, speed=1.0, seed=seed, force_tokens=force, arrival=0.0, frontend_s=0.0,
                  feed=BistreamFeed(plan, source, _ids, idle_timeout=600.0, force=force))
    return req, source


def _lone_streamed(seed: int) -> tuple[SpeechLLM, LLMRunner, Scheduler, Request, TextStream]:
    """A one-slot scheduler on the tiny LLM (CPU) running one streamed-text request with no prompt."""
    llm = random_model("tiny", 0).llm
    runner = LLMRunner(llm, 1, MAX_SEQ, torch.float32, torch.device("cpu"), cuda_graphs=False)
    sched = Scheduler(1, llm.cfg.stop_token_ids)
    req, source = _streamed(llm, seed, [], [])
    sched.submit(req)
    return llm, runner, sched, req, source


TEXTS = [list(range(100, 140)), list(range(300, 323))]
PROMPTS = [(list(range(50, 56)), list(range(1000, 1022))), ([], [])]
SEEDS = [21, 22]


def _decode_streamed(llm, runner: LLMRunner, with_others: bool) -> list[list[int]]:
    """Two streamed-text requests (with and without prompt speech), with two whole-text ones or alone, text arriving
    a few ids at a time between steps -> each streamed one's speech."""
    sched = Scheduler(4, llm.cfg.stop_token_ids)
    streamed = [_streamed(llm, s, pt, ps) for (pt, ps), s in zip(PROMPTS, SEEDS, strict=True)]
    others = [_llm_request(llm, 31, 4), _llm_request(llm, 32, 3, force=40)] if with_others else []
    for req in [r for r, _ in streamed] + others:
        sched.submit(req)
    left = [list(t) for t in TEXTS]
    step = 0
    while sched.running or sched.waiting:
        for (_, source), rest in zip(streamed, left, strict=True):
            if rest and step % 2 == 0:
                source.push(" ".join(str(i) for i in rest[:3]))
                del rest[:3]
            elif not rest and not source.closed:
                source.close()
        sched.step(runner)
        step += 1
    assert all(r.piece.done for r, _ in streamed)
    return [list(r.piece.tokens) for r, _ in streamed]


@torch.inference_mode()
def test_streamed_text_in_the_batch_decodes_as_alone() -> None:
    """Two streamed-text requests and two whole-text ones share the batch; text arrives a few ids at a time between
    steps. Each streamed one's speech equals upstream's procedure run alone with the same sampler, and the
    whole-text ones equal themselves alone."""
    llm = random_model("tiny", 0).llm
    refs = [_reference(llm, t, pt, ps, s) for t, (pt, ps), s in zip(TEXTS, PROMPTS, SEEDS, strict=True)]

    def runner() -> LLMRunner:
        return LLMRunner(llm, 4, MAX_SEQ, torch.float32, torch.device("cpu"), cuda_graphs=False)

    assert _decode_streamed(llm, runner(), with_others=True) == refs
    assert _decode_streamed(llm, runner(), with_others=False) == refs
    assert all(len(r) > 2 * llm.cfg.mix_ratio[1] for r in refs)


@pytest.mark.gpu  # CUDA graphs
@torch.inference_mode()
def test_graphed_text_blocks_decode_as_eager_ones() -> None:
    """On CUDA, streamed-text blocks fed through the captured extend graphs (rows padded to their batch bucket with
    copies of the first) make the same speech as the eager forwards."""
    llm = random_model("tiny", 0).llm.cuda()
    graphed, eager = (LLMRunner(llm, 4, MAX_SEQ, torch.float32, torch.device("cuda"), cuda_graphs=g)
                      for g in (True, False))
    use = LLMGraphUse(graphed)
    runs = [_decode_streamed(llm, runner, with_others=True) for runner in (graphed, eager)]
    assert runs[0] == runs[1] and all(runs[0])
    assert use.extend_replays > 0 and use.all_decodes_replayed(), vars(use)  # the graphs ran them


@torch.inference_mode()
def test_a_request_waiting_for_text_costs_no_decode_step(monkeypatch) -> None:
    llm = random_model("tiny", 0).llm
    runner = LLMRunner(llm, 2, MAX_SEQ, torch.float32, torch.device("cpu"), cuda_graphs=False)
    sched = Scheduler(2, llm.cfg.stop_token_ids)
    req, source = _streamed(llm, 5, [], [])
    sched.submit(req)
    decodes = []
    real = runner.decode
    monkeypatch.setattr(runner, "decode", lambda *a, **k: decodes.append(a) or real(*a, **k))
    source.push("1 2 3")  # fewer than 5 text ids: nothing to decode yet
    sched.step(runner)
    assert sched.running == [req] and req.kv_len == 0 and not decodes
    assert not sched._has_work()  # the engine thread sleeps until text arrives
    assert req.feed.waits_for_text  # a pause in its audio now is its client's (admission does not count it)
    source.push("4 5")
    assert sched._has_work()
    sched.step(runner)
    assert not req.feed.waits_for_text  # its cycle decodes
    while not req.piece.tokens or sched._has_work():  # one cycle: 15 speech tokens, then the fill
        sched.step(runner)
    assert len(req.piece.tokens) == llm.cfg.mix_ratio[1] and sched.running == [req]
    n_decodes, kv_len = len(decodes), req.kv_len
    sched.step(runner)
    assert len(decodes) == n_decodes and req.kv_len == kv_len  # parked: no step, no position
    source.close()
    while sched.running:
        sched.step(runner)
    assert req.piece.done


@torch.inference_mode()
def test_text_that_arrives_while_the_lone_request_makes_its_first_audio_is_fed() -> None:
    """The step that takes a text block starts the row's decode cycle; when it is the lone request and the vocoder is
    making its first audio (the scheduler then holds decode), the block is still fed, not dropped with the cycle
    left started and nothing to feed it (the row then never decoded again: a hang)."""
    llm, runner, sched, req, source = _lone_streamed(7)
    n_speech = llm.cfg.mix_ratio[1]
    source.push("1 2 3 4 5")
    while not req.piece.tokens or sched._has_work():  # one cycle: 15 speech tokens, then the fill; parked
        sched.step(runner)
    assert len(req.piece.tokens) == n_speech
    req.first_audio_busy = True  # the vocoder is making this request's first audio
    source.push("6 7 8 9 10")
    sched.step(runner)
    req.first_audio_busy = False
    for _ in range(4 * n_speech):
        if not sched._has_work():
            break
        sched.step(runner)
    assert len(req.piece.tokens) == 2 * n_speech


@torch.inference_mode()
def test_each_cycle_is_stamped_with_the_arrival_of_the_text_it_waited_for() -> None:
    """`text_arrival_for(token)`: the push holding the last text id that the cycle making `token` took; a cycle that
    starts on ids left over from an earlier push waited for that push."""
    llm, runner, sched, req, source = _lone_streamed(9)
    n = llm.cfg.mix_ratio[1]

    def run_cycle() -> None:
        while sched._has_work():
            sched.step(runner)

    source.push("1 2 3 4 5")
    run_cycle()
    source.push("6 7")
    sched.step(runner)  # two ids: nothing starts
    source.push("8 9 10")
    run_cycle()
    source.push("11 12 13 14 15 16 17 18 19 20")
    run_cycle()  # a cycle on 11-15, then parked with 16-20 taken but not pushed into the plan
    sched.step(runner)
    run_cycle()  # the next poll starts a cycle on 16-20, which arrived with the fourth push
    assert len(req.piece.tokens) == 4 * n
    t = source.push_times
    assert source.unlocked_at == t[0] == req.feed.text_arrival_for(0) == req.feed.text_arrival_for(n - 1)
    assert req.feed.text_arrival_for(n) == req.feed.text_arrival_for(2 * n - 1) == t[2]
    assert req.feed.text_arrival_for(2 * n) == req.feed.text_arrival_for(4 * n - 1) == t[3]


def test_a_cycle_input_no_step_fed_is_offered_again() -> None:
    llm = random_model("tiny", 0).llm
    req, source = _streamed(llm, 3, [], [])
    source.push("1 2 3 4 5")
    first = req.feed.poll(0.0)
    assert first is not None and req.feed.poll(0.0) == first  # a step that could not launch it loses nothing
    req.feed.start_cycle(input_length(first), MAX_SEQ)
    assert req.feed.poll(0.0) is None  # fed: its rows are under way


@pytest.mark.parametrize("seed", [1, 2, 3])
@torch.inference_mode()
def test_a_forced_length_ends_the_final_phase_there(seed) -> None:
    """`force_tokens` (benchmarks): the final phase ignores eos and ends at that many speech tokens in all; when the
    text phase already made more, the speech ends with the text's."""
    llm = random_model("tiny", 0).llm
    n_speech = llm.cfg.mix_ratio[1]
    for force, text in ((3 * n_speech + 7, list(range(100, 110))), (n_speech // 2, list(range(100, 110)))):
        runner = LLMRunner(llm, 1, MAX_SEQ, torch.float32, torch.device("cpu"), cuda_graphs=False)
        sched = Scheduler(1, llm.cfg.stop_token_ids)
        req, source = _streamed(llm, seed, [], [], force=force)
        sched.submit(req)
        source.push(" ".join(map(str, text)))
        source.close()
        while sched.running or sched.waiting:
            sched.step(runner)
        text_phase = 2 * n_speech  # 10 text ids: two cycles of 15 speech tokens
        assert req.piece.done and len(req.piece.tokens) == max(force, text_phase)


# ---------------------------------------------------------------- through the engine

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = Engine(quiet_source_model, EngineConfig(random_size="tiny", device="cpu", text_idle_timeout=0.5,
                                                voices_dir=str(tmp_path_factory.mktemp("voices"))))
    yield e
    e.close()


def _request(text, **kw) -> SynthesisRequest:
    base = {"text": text, "prompt_audio": prompt_wav(), "prompt_text": "a prompt text", "seed": 3}
    return SynthesisRequest(**{**base, **kw})


def _idle(engine) -> bool:
    return engine.stats()["running"] == 0 and engine._parts.vocoder.idle()


def test_audio_starts_before_the_text_ends(engine) -> None:
    source = TextStream()
    it = engine.stream(_request(source, mode=Mode.CROSS_LINGUAL))
    for _ in range(40):
        source.push("hello there ")
    first = next(it)  # waits for audio, with the text still open
    assert not first.is_last and not source.closed
    assert source.first_audio_text_at in source.push_times and source.first_audio_text_at >= source.unlocked_at
    (req,) = engine._parts.vocoder.requests()  # its reservation covers its speech so far, not the longest text
    flow = engine._parts.vocoder.flow_runner
    assert req.pages < flow.pages_for_tokens(req.prompt.tokens.shape[1] + req.piece.max_len)
    source.close()
    rest = list(it)
    assert rest[-1].is_last and [c.index for c in [first, *rest]] == list(range(len(rest) + 1))
    assert wait_until(lambda: _idle(engine))
    assert engine._sched.admission.pages_held == 0  # whatever it grew to came back


def test_a_streamed_text_keeps_its_hop_while_its_text_arrives(engine) -> None:
    """While the text is open the chunks after the first are of upstream's first hop (25 tokens), not doubling as
    upstream's (50, 100): the speech comes at the text's pace. Once the text has ended the hop grows again."""
    source = TextStream()
    it = engine.stream(_request(source, mode=Mode.CROSS_LINGUAL))
    for _ in range(40):
        source.push("hello there ")
    open_chunks = [next(it) for _ in range(4)]
    assert not source.closed and not any(c.is_last for c in open_chunks)
    cfg = engine._parts.vocoder.stream_cfg
    hop_samples = cfg.token_hop_len * cfg.token_mel_ratio * engine.sample_rate // 50  # 50 mel frames per second
    assert [len(c.pcm) for c in open_chunks[1:]] == [hop_samples] * 3
    source.close()
    rest = list(it)
    assert rest[-1].is_last and max(len(c.pcm) for c in rest) > hop_samples  # the final phase's hops grow
    assert wait_until(lambda: _idle(engine))


def test_text_that_stops_arriving_ends_the_request(engine) -> None:
    source = TextStream()
    it = engine.stream(_request(source))
    source.push("a few words of text that then stop")
    chunks = list(it)  # never closed: the idle limit ends the text, and the speech finishes
    assert chunks and chunks[-1].is_last and not source.closed
    assert wait_until(lambda: _idle(engine))


def test_an_iterable_of_strings_streams(engine) -> None:
    chunks = list(engine.stream(_request(iter(["one two three ", "four five six ", "seven eight nine ten"]))))
    assert chunks[-1].is_last and sum(len(c.pcm) for c in chunks) > 0


def test_a_client_that_goes_away_frees_everything(engine) -> None:
    source = TextStream()
    it = engine.stream(_request(source))
    for _ in range(40):
        source.push("more and more text ")
    next(it)
    it.close()
    assert wait_until(lambda: _idle(engine))
    assert_pool_free(engine._parts.vocoder.flow_runner)
    assert engine._sched.admission.pages_held == 0 and engine._sched.admission.streams_held == 0


@pytest.mark.parametrize("kw", [{"stream": False}, {"max_tokens": 10}])
def test_streamed_text_refuses_whole_clip_options(engine, kw) -> None:
    with pytest.raises(InputError):
        engine.stream(_request(TextStream(), **kw))


def _token_pieces(engine, text: str) -> list[str]:
    """`text` as the tokenizer's tokens, one string each: one text id per push."""
    pieces = [engine.tokenizer.decode([i]) for i in engine.tokenizer.encode(text)]
    assert all(len(engine.tokenizer.encode(p)) == 1 for p in pieces)
    return pieces


@pytest.mark.parametrize("mode", [Mode.CROSS_LINGUAL, Mode.ZERO_SHOT])
def test_the_push_that_completes_the_text_decoding_waits_for_stamps_the_source(engine, mode) -> None:
    """Decoding starts once the prompt's speech is interleaved with text (5 text ids per 15 prompt tokens, the prompt
    text counted first) and, without prompt speech, once 5 text ids arrived; the source records the push that
    completed that, not the call or a later push."""
    pieces = _token_pieces(engine, "the quick brown fox jumps over the lazy dog and the quick brown fox sleeps " * 2)
    n_text, n_speech = engine._parts.model.llm.cfg.mix_ratio
    if mode == Mode.ZERO_SHOT:
        prompt_speech = engine.prompt_features(prompt_wav()).speech_tokens.shape[-1]
        prompt_text = len(engine.tokenizer.encode("a prompt text"))
        needed = n_text * -(-prompt_speech // n_speech) - prompt_text
    else:
        needed = n_text
    assert 1 < needed < len(pieces)
    source = TextStream()
    for piece in pieces:
        source.push(piece)
    source.close()
    assert list(engine.stream(_request(source, mode=mode)))[-1].is_last
    assert source.unlocked_at == source.push_times[needed - 1]
    assert wait_until(lambda: _idle(engine))


def test_text_that_ends_before_the_first_block_unlocks_at_its_end(engine) -> None:
    source = TextStream()
    for piece in _token_pieces(engine, "the fox")[:3]:
        source.push(piece)
    source.close()
    assert list(engine.stream(_request(source, mode=Mode.CROSS_LINGUAL)))[-1].is_last
    assert source.unlocked_at == source.closed_at is not None
    assert wait_until(lambda: _idle(engine))


def test_a_paced_pump_pushes_every_piece_in_order() -> None:
    """`pump(rate=...)` pushes every piece, each a push of its own, then closes; a stop ends it early."""
    source = TextStream.pump(["a", "b", "c", "d"], rate=200.0)
    assert wait_until(lambda: source.closed)
    pieces, closed = source.take()
    assert pieces == ["a", "b", "c", "d"] and closed and len(source.push_times) == 4
    assert source.push_times == sorted(source.push_times) and source.closed_at >= source.push_times[-1]
    stopped = TextStream.pump(["a", "b", "c"], stop=lambda: True, rate=200.0)
    assert wait_until(lambda: stopped.closed) and stopped.take() == ([], True)
    with pytest.raises(ValueError, match="positive"):
        TextStream.pump(["a"], rate=0)


@torch.inference_mode()
def test_a_streamed_text_reservation_grows_with_its_speech_and_waits_for_pages() -> None:
    """A streamed-text request starts with a small reservation. Its speech never passes what its reservation
    covers: it grows while pages are unreserved; while another request holds them its row waits (no decode step),
    and it goes on once they are given back. Admission never holds more pages than the pool has."""
    from cosyvoice_opt.engine.admission import ROOM_GROW_TOKENS, Admission

    llm = random_model("tiny", 0).llm
    runner = LLMRunner(llm, 2, MAX_SEQ, torch.float32, torch.device("cpu"), cuda_graphs=False)
    pages_for = lambda req, tokens: tokens // 25  # noqa: E731 - one page per 25 speech tokens
    admission = Admission(pages=16, streams=4, max_queue_wait=60.0)
    sched = Scheduler(2, llm.cfg.stop_token_ids, admission, pages_for=pages_for)
    req, source = _streamed(llm, 7, [], [])
    req.token_room, req.pages = 30, 1
    growth = pages_for(req, 30 + ROOM_GROW_TOKENS) - req.pages
    blocker = Request([TextPiece(torch.arange(4), None, 0, 10)], req.prompt, stream=True, speed=1.0, seed=0,
                      force_tokens=None, arrival=0.0, frontend_s=0.0, pages=16 - req.pages - growth + 1)
    sched.submit(req)
    sched.step(runner)
    admission.take(blocker.pages)  # admitted elsewhere: it holds the pages the growth needs
    blocker.admitted = True
    source.push(" ".join(str(i) for i in range(100, 140)))
    for _ in range(200):
        sched.step(runner)
        assert len(req.piece.tokens) <= req.token_room and admission.pages_held <= admission.pages
        if req.room_wait_since is not None and not sched._has_work():
            break
    assert req.token_room == 30 and req.pages == 1 and sched.running == [req]  # waiting: it could not grow
    tokens = len(req.piece.tokens)
    sched.step(runner)
    assert len(req.piece.tokens) == tokens  # no decode step while it waits
    sched.release(blocker)
    assert sched._has_work()  # the pages came back: it grows and decodes
    source.close()
    while sched.running:
        sched.step(runner)
        assert len(req.piece.tokens) <= req.token_room and admission.pages_held <= admission.pages
    assert req.piece.done and len(req.piece.tokens) > tokens and req.token_room > 30
    assert req.pages == pages_for(req, req.token_room) and req.room_wait_since is None


@torch.inference_mode()
def test_a_streamed_text_waiting_too_long_for_pages_fails_clearly() -> None:
    from cosyvoice_opt.engine.admission import ROOM_WAIT_S, Admission

    llm = random_model("tiny", 0).llm
    runner = LLMRunner(llm, 2, MAX_SEQ, torch.float32, torch.device("cpu"), cuda_graphs=False)
    admission = Admission(pages=3, streams=4, max_queue_wait=60.0)
    sched = Scheduler(2, llm.cfg.stop_token_ids, admission, pages_for=lambda req, tokens: tokens // 10)
    req, source = _streamed(llm, 8, [], [])
    req.token_room, req.pages = 30, 3  # the whole pool: it can never grow
    sched.submit(req)
    source.push(" ".join(str(i) for i in range(100, 200)))
    while req.room_wait_since is None:
        sched.step(runner)
    assert sched._room_timeout() == pytest.approx(ROOM_WAIT_S, abs=1.0)  # the engine thread wakes for it
    req.room_wait_since -= ROOM_WAIT_S  # as if it had waited that long
    sched.step(runner)
    assert req.cancelled and not sched.running and sched.stats()["failed"] == 1
    error = req.out.get_nowait()  # the speech so far went to the vocoder, not to `out`: the error comes first
    assert isinstance(error, Exception) and "no flow memory left" in str(error)
