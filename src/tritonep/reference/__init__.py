"""The oracle: what every rank must receive, computed from the inputs of all ranks in plain PyTorch.

Every function takes per-rank inputs as lists indexed by rank and runs on any device. Later
tests compare each Triton kernel against these functions; keep them slow and obvious.

* :mod:`.layout` -- where each token goes (``-1`` = no expert);
* :mod:`.normal` -- normal-mode dispatch (exact size, once per rank) and combine;
* :mod:`.low_latency` -- low-latency dispatch (per-expert slabs) and weighted combine;
* :mod:`.elastic` -- DeepEP V2's layouts (plain, expanded per expert) and its ordered combine;
* :mod:`.fp8` -- FP8 e4m3 per-128-channel quantization and de-quantization;
* :mod:`.logfmt` -- the LogFMT-10 format of a ``use_logfmt`` low-latency combine;
* :mod:`.compare` -- strict, block-order-independent comparisons.
"""

from .compare import assert_bitwise_equal, assert_low_latency_dispatch_equal, assert_rows_equal
from .elastic import (
    ElasticDispatchResult,
    elastic_combine,
    elastic_combine_unreduced,
    elastic_dispatch,
    rank_partials,
    reduction_order,
)
from .fp8 import (
    AMAX_FLOOR,
    FP8_MAX,
    dequantize_fp8,
    fp8_scales,
    pack_ue8m0,
    quantize_fp8,
    round_scale_to_pow2,
    unpack_ue8m0,
)
from .layout import DispatchLayout, dispatch_layout, expert_owner
from .logfmt import logfmt_error_bound, logfmt_params, logfmt_round_trip
from .low_latency import (
    LowLatencyDispatchResult,
    low_latency_combine,
    low_latency_dispatch,
    pack_range,
    unpack_range,
    without_ranks,
)
from .normal import NormalDispatchResult, align_up, normal_combine, normal_dispatch

__all__ = [
    "AMAX_FLOOR",
    "FP8_MAX",
    "DispatchLayout",
    "ElasticDispatchResult",
    "LowLatencyDispatchResult",
    "NormalDispatchResult",
    "align_up",
    "assert_bitwise_equal",
    "assert_low_latency_dispatch_equal",
    "assert_rows_equal",
    "dequantize_fp8",
    "dispatch_layout",
    "elastic_combine",
    "elastic_combine_unreduced",
    "elastic_dispatch",
    "expert_owner",
    "fp8_scales",
    "logfmt_error_bound",
    "logfmt_params",
    "logfmt_round_trip",
    "low_latency_combine",
    "low_latency_dispatch",
    "normal_combine",
    "normal_dispatch",
    "pack_range",
    "pack_ue8m0",
    "quantize_fp8",
    "rank_partials",
    "reduction_order",
    "round_scale_to_pow2",
    "unpack_range",
    "unpack_ue8m0",
    "without_ranks",
]
