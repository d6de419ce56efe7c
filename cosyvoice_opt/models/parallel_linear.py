"""Several `nn.Linear`s over the same input as one matmul, without changing the checkpoint's keys.

Small-batch inference is launch-bound: q/k/v (or gate/up, or an attention's k/v) as one kernel instead of several
is a direct saving, and CUDA graphs replay whatever was captured, so fewer kernels means shorter replays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ParallelLinear:
    """`nn.Linear`s reading the same input, applied as one matmul once `fuse_()` has concatenated their weights.

    Not a module: the Linears stay where they are, so `state_dict()` keys do not change. After `fuse_()` their
    parameters are views into the fused tensors (no extra memory) and `load_state_dict` (which copies into the
    parameters) updates the fused tensors too. Anything that replaces the parameters instead (`.to()` to another
    dtype or device, `load_state_dict(assign=True)`) breaks the aliasing; the next call then raises.
    """

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.weight: Tensor | None = None
        self.bias: Tensor | None = None

    @torch.no_grad()
    def fuse_(self) -> None:
        self.weight = torch.cat([m.weight for m in self.linears])
        has_bias = self.linears[0].bias is not None
        self.bias = torch.cat([m.bias for m in self.linears]) if has_bias else None
        start = 0
        for m in self.linears:
            end = start + m.out_features
            m.weight.data = self.weight[start:end]
            if has_bias:
                m.bias.data = self.bias[start:end]
            start = end

    def __call__(self, x: Tensor, first: int = 0) -> Tensor:
        """The outputs of the Linears from the `first` on, concatenated on the last axis."""
        if self.weight is None:
            return torch.cat([m(x) for m in self.linears[first:]], dim=-1)
        # checked eagerly only: under torch.compile the check would break the graph in every layer (data_ptr() is
        # not traceable), and a compiled step is traced from the module as it is, after the last .to()
        if not torch.compiler.is_compiling() and self.linears[0].weight.data_ptr() != self.weight.data_ptr():
            raise RuntimeError("fused projections no longer alias their parameters (the module was moved or its "
                               "parameters replaced after fuse_projections_()); call fuse_projections_() again")
        start = sum(m.out_features for m in self.linears[:first])
        return F.linear(x, self.weight[start:], None if self.bias is None else self.bias[start:])

    def each(self, x: Tensor) -> tuple[Tensor, ...]:
        """Each Linear's output (views of the one matmul's)."""
        return self(x).split([m.out_features for m in self.linears], dim=-1)
