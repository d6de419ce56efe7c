"""Every limit a user can run into, in one place: the engine, the HTTP API, the WebUI and the CLI all read these,
so they accept and refuse the same requests with the same numbers."""

from __future__ import annotations

# Request options
MAX_SEED = 2**32 - 1  # numpy's seed range, as upstream's set_all_random_seed
SPEED_RANGE = (0.5, 2.0)  # upstream's non-streaming mel time-stretch; beyond it the speech is garbled
MAX_TEXT_CHARS = 4096  # OpenAI's limit for /v1/audio/speech; a longer text is several requests

# Prompt audio
MIN_PROMPT_SECONDS = 0.5
MAX_PROMPT_SECONDS = 30.0
RECOMMENDED_PROMPT_SECONDS = (3.0, 10.0)  # a "3 s clone": a few seconds of clean speech clone best
MIN_PROMPT_SAMPLE_RATE = 16000
MAX_UPLOAD_MIB = 20  # 30 s is < 12 MiB even as 48 kHz stereo float WAV: anything bigger is not a prompt
MAX_UPLOAD_BYTES = MAX_UPLOAD_MIB << 20

# Serving
MAX_QUEUE_WAIT_S = 5.0  # default: a request that cannot start within this is refused as busy (HTTP 503)
MAX_QUEUE_WAIT_RANGE = (0.0, 600.0)

# Bidirectional streaming (text arrives while the speech is made)
TEXT_IDLE_S = 10.0  # default: text that stops arriving for this long ends the request (it speaks what it has)
TEXT_IDLE_RANGE = (0.1, 600.0)
MAX_STREAM_TEXT_CHARS = 4 * MAX_TEXT_CHARS  # one streamed request's whole text; the KV slot is the tighter bound
LIVE_WORDS_PER_S = 4.0  # WebUI live text: the default rate its words arrive at (a chat model's reply)
LIVE_WORDS_PER_S_RANGE = (0.5, 30.0)
