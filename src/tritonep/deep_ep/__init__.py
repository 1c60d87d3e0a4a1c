"""DeepEP's Python interface on tritonep: ``import tritonep.deep_ep as deep_ep``.

Code written for DeepEP's V1 :class:`Buffer` (``deep_ep/buffers/legacy.py``: normal and
low-latency modes, the API vLLM, SGLang and Megatron-Core used first, with :class:`Config`)
runs unchanged, with the same class and method names, argument names and order, defaults,
return tuples, shapes and dtypes, and :class:`EventOverlap`, :class:`EventHandle` (also in
:mod:`tritonep.deep_ep.utils`) and ``topk_idx_t`` (int64). Every difference from DeepEP is
listed in ``docs/deepep-compat.md``.
"""

from __future__ import annotations

import torch

from .legacy import Buffer, Config, LegacyHandle
from .utils import EventHandle, EventOverlap

__all__ = [
    "Buffer",
    "Config",
    "EventHandle",
    "EventOverlap",
    "LegacyHandle",
    "topk_idx_t",
]

#: The DeepEP release whose interface this module follows.
__version__ = "1.2.1"

#: The dtype of top-k expert ids (DeepEP's ``deep_ep.topk_idx_t``).
topk_idx_t = torch.int64
