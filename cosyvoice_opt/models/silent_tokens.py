"""CosyVoice3's silent-token rule (upstream `CosyVoice3Model.llm_job`): in a run of consecutive silent speech tokens
the flow receives the first `max_run`; later ones are dropped. The LLM has already consumed them all; only the
flow's token list is filtered, so long pauses stay bounded. CosyVoice2 has no silent ids."""

from __future__ import annotations

from collections.abc import Iterable

SILENT_TOKENS = (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)  # upstream's `silent_tokens`
MAX_SILENT_RUN = 5  # upstream's `max_silent_token_num`


class SilentRunFilter:
    """Token by token, as the LLM yields them: `keep(token)` says whether the flow receives it."""

    def __init__(self, silent_tokens: Iterable[int] = SILENT_TOKENS, max_run: int = MAX_SILENT_RUN):
        self.silent = frozenset(int(t) for t in silent_tokens)
        self.max_run = max_run
        self.run = 0

    def keep(self, token: int) -> bool:
        if token not in self.silent:
            self.run = 0
            return True
        self.run += 1
        return self.run <= self.max_run


def drop_long_silences(
    tokens: Iterable[int], silent_tokens: Iterable[int] = SILENT_TOKENS, max_run: int = MAX_SILENT_RUN,
) -> list[int]:
    """`tokens` without the silent ids past the first `max_run` of each run."""
    rule = SilentRunFilter(silent_tokens, max_run)
    return [t for t in tokens if rule.keep(int(t))]
