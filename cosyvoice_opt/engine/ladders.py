"""Shape ladders: the few sizes that batches, sequences and chunks are padded to, so that a fixed set of CUDA graphs,
captured at start-up, covers every request the engine accepts."""

from __future__ import annotations


def ladder(limit: int, first: int = 1, halves: bool = False) -> list[int]:
    """first, 2·first, 4·first, ... below `limit`, then `limit` itself; with `halves`, also the rung halfway
    between two of them from 2·first on (3·first, 6·first, 12·first, ...): padding then adds at most a half."""
    out, n = [], first
    while n < limit:
        out.append(n)
        if halves and n > first and n + n // 2 < limit:
            out.append(n + n // 2)
        n *= 2
    return out + [limit]


def round_up(n: int, options: list[int]) -> int | None:
    """The smallest of `options` (ascending) that is at least `n`; None when `n` is beyond them all."""
    return next((o for o in options if o >= n), None)
