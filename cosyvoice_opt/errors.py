"""Errors that reach users as one clear line (what was wrong, what is accepted)."""


class CosyVoiceError(Exception):
    """Base class: its message is safe to show to a user (no paths from the server, no traceback)."""


class InputError(CosyVoiceError, ValueError):
    """A request's text, audio or options were rejected."""


class CheckpointError(CosyVoiceError):
    """A model folder or checkpoint file is missing, corrupt or does not match the contract."""
