"""Errors that reach users as one clear line (what was wrong, what is accepted)."""


class CosyVoiceError(Exception):
    """Base class: its message is safe to show to a user (no paths from the server, no traceback)."""


class InputError(CosyVoiceError, ValueError):
    """A request's text, audio or options were rejected."""


class PromptTooLong(InputError):
    """A voice's transcript and audio together leave no room in one request for the text to speak."""


class CheckpointError(CosyVoiceError):
    """A model folder or checkpoint file is missing, corrupt or does not match the contract."""


class EngineBusy(CosyVoiceError):
    """The engine is at capacity and the request could not start within the queue's bound: refused, not failed.
    `retry_after` is a hint in seconds (HTTP 503 `Retry-After`)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDead(CosyVoiceError):
    """The GPU context is unusable (a CUDA error poisoned it): every request fails and the process must restart."""


def first_sentence(error: BaseException, limit: int = 160) -> str:
    """A library error's first sentence for a one-line message: never cut mid-word, and marked with … where it is
    longer than `limit` characters (library messages run on: 'failed finding central directory. This is an internal
    miniz error. If you are seeing this error, ...')."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    line = text.splitlines()[0].strip()
    sentence = line.split(". ", 1)[0].rstrip(".")
    if len(sentence) <= limit:
        return sentence
    return sentence[:limit].rsplit(" ", 1)[0].rstrip(",;:") + "…"
