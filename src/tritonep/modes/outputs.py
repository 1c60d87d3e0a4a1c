"""Outputs of the modes' calls: fresh tensors, filled with a marker when testing.

With ``TRITONEP_POISON_OUTPUTS=1`` in the environment (the test suite sets it in every rank
process) every output is filled with 0xFF bytes before the kernels write it, NaN for floats
and -1 for integers, so that rows a kernel failed to write show instead of passing as stale
memory. Off, an output costs one allocation.
"""

from __future__ import annotations

import os

import torch

POISON_OUTPUTS = os.environ.get("TRITONEP_POISON_OUTPUTS", "0") not in ("", "0")


def empty_output(device: torch.device, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new ``shape`` tensor of ``dtype`` on ``device`` (poisoned with POISON_OUTPUTS)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON_OUTPUTS:
        t.view(torch.uint8).fill_(0xFF)
    return t
