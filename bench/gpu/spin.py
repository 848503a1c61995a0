"""A Triton kernel that only computes: each of `blocks` programs runs `iterations` multiply-adds on 128 lanes
and writes its lanes once. Imported only on a GPU machine (Triton compiles for the GPU it finds)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def spin_kernel(out_ptr, iterations):  # type: ignore[no-untyped-def]
    lanes = tl.arange(0, 128)
    x = lanes.to(tl.float32) + tl.program_id(0)
    for _ in range(iterations):
        x = x * 0.999999 + 0.000001
    tl.store(out_ptr + tl.program_id(0) * 128 + lanes, x)


def launch(out: torch.Tensor, blocks: int, iterations: int) -> None:
    spin_kernel[(blocks,)](out, iterations)
