"""DeepEP's Python interface on tritonep: ``import tritonep.deep_ep as deep_ep``.

Code written for DeepEP runs unchanged through both of its APIs:

* V1, :class:`Buffer` (``deep_ep/buffers/legacy.py``: normal and low-latency modes, the API
  vLLM, SGLang and Megatron-Core used first), with :class:`Config`;
* V2, :class:`ElasticBuffer` and :class:`EPHandle` (``deep_ep/buffers/elastic.py``, DeepEP
  2.1: one dispatch and combine for training, prefill and decode);

with the same class and method names, argument names and order, defaults, return tuples,
shapes and dtypes, and :class:`EventOverlap`, :class:`EventHandle` (also in
:mod:`tritonep.deep_ep.utils`), :func:`get_physical_domain_size`,
:func:`get_logical_domain_size` and ``topk_idx_t`` (int64). Every difference from DeepEP, for
both APIs, is listed in ``docs/deepep-compat.md``.
"""

from __future__ import annotations

import torch

from .elastic import ElasticBuffer, EPHandle, get_logical_domain_size, get_physical_domain_size
from .legacy import Buffer, Config, LegacyHandle
from .utils import EventHandle, EventOverlap

__all__ = [
    "Buffer",
    "Config",
    "EPHandle",
    "ElasticBuffer",
    "EventHandle",
    "EventOverlap",
    "LegacyHandle",
    "get_logical_domain_size",
    "get_physical_domain_size",
    "topk_idx_t",
]

#: The DeepEP release whose interface this module follows.
__version__ = "2.1.0"

#: The dtype of top-k expert ids (DeepEP's ``deep_ep.topk_idx_t``).
topk_idx_t = torch.int64
