"""Static KV cache of the Qwen2 backbone: one preallocated tensor, one slot per running request.

The engine owns it and sizes it (`bytes_per_slot` against free memory). Shapes never change, so decode
steps that read and write it can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch

from cosyvoice_opt.config import Qwen2Config


class KVCache:
    """`data[layer, 0 | 1, slot, kv_head, position, head_dim]` holds rotated keys (0) and values (1).

    Slot `s` holds one request's sequence at positions `0 .. len-1`; entries past a request's length are
    never read (attention masks them), so a freed slot needs no clearing.
    """

    def __init__(
        self,
        cfg: Qwen2Config,
        num_slots: int,
        max_seq: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if num_slots < 1 or max_seq < 1:
            raise ValueError(f"KV cache needs num_slots >= 1 and max_seq >= 1, got {num_slots}, {max_seq}")
        self.num_slots = num_slots
        self.max_seq = max_seq
        self.data = torch.zeros(
            cfg.num_layers, 2, num_slots, cfg.num_kv_heads, max_seq, cfg.head_dim, dtype=dtype, device=device
        )

    @staticmethod
    def bytes_per_slot(cfg: Qwen2Config, max_seq: int, dtype: torch.dtype) -> int:
        """Memory one slot of `max_seq` positions takes: for sizing the cache from free memory."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cfg.num_layers * 2 * cfg.num_kv_heads * max_seq * cfg.head_dim * itemsize

    def layer(self, index: int) -> torch.Tensor:
        """View `[2, num_slots, kv_heads, max_seq, head_dim]` of one layer."""
        return self.data[index]

    def copy_slot(self, src: int, dst: int, length: int | None = None) -> None:
        """Move a request to another slot (e.g. to keep running requests in slots `0..B-1`)."""
        n = self.max_seq if length is None else length
        self.data[:, :, dst, :, :n].copy_(self.data[:, :, src, :, :n])
