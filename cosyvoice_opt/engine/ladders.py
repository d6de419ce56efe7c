"""Shape ladders: the few sizes that batches, sequences and chunks are padded to, so that a fixed set of CUDA graphs,
captured at start-up, covers every request the engine accepts."""

from __future__ import annotations


def ladder(limit: int, first: int = 1) -> list[int]:
    """first, 2·first, 4·first, ... below `limit`, then `limit` itself."""
    out, n = [], first
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit]


def round_up(n: int, options: list[int]) -> int | None:
    """The smallest of `options` (ascending) that is at least `n`; None when `n` is beyond them all."""
    return next((o for o in options if o >= n), None)
