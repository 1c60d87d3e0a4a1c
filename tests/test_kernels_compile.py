"""Every kernel compiles for Hopper (sm_90) on this machine, GPU or not.

The interpreter accepts code that the compiler rejects, so the CPU suite also runs Triton's
real compiler (front end, LLVM and ptxas) for an H100/H200 target. It runs in a subprocess
with ``TRITON_INTERPRET=0`` because this process builds its kernels for the interpreter.
"""

import functools
import inspect
import json
import os
import re
import subprocess
import sys

import pytest
import triton
import triton.language as tl

from tritonep.kernels import (
    elastic_exchange,
    layout,
    normal_combine,
    normal_copy_combine,
    normal_dispatch,
    normal_notify,
)
from tritonep.kernels.nvshmem import _DEVICE_STATE
from tritonep.kernels.transport import copy_bytes
from tritonep.modes import copy_combine
from tritonep.modes.normal import COMBINE_WARPS, DISPATCH_WARPS, NormalLayout

pytest.importorskip("triton.backends.nvidia")

# kernel module, kernel name, signature, constexprs
KERNELS = [
    (
        "tritonep.kernels.put_signal",
        "put_signal_kernel",
        {
            "src_ptr": "*i32",
            "num_elems": "i32",
            "peer_ptrs": "*i64",
            "peer": "i32",
            "data_offset": "i64",
            "flag_offset": "i64",
            "value": "i32",
            "BLOCK": "constexpr",
        },
        {"BLOCK": 1024},
    ),
    (
        "tritonep.kernels.put_signal",
        "wait_signal_kernel",
        {
            "peer_ptrs": "*i64",
            "rank": "i32",
            "peer": "i32",
            "flag_offset": "i64",
            "value": "i32",
            "timeout_us": "i32",
            "status_ptr": "*i32",
            "USE_CLOCK": "constexpr",
        },
        {"USE_CLOCK": True},
    ),
]

LL_SHARED = {
    "peer_ptrs": "*i64",
    "pe_ptr": "*i32",
    "rank": "i32",
    "state_ptr": "*i64",
    "scratch_ptr": "*i32",
    "expert_done_ptr": "*i32",
    "status_ptr": "*i32",
    "timeout_us": "i32",
    "mask_ptr": "*i32",
    "verdict_ptr": "*i64",
    "skipped_ptr": "*i64",
}
LL_DISPATCH = {
    "x_ptr": "*bf16",
    "topk_idx_ptr": "*i64",
    "num_tokens": "i32",
    "out_x_ptr": "*fp8e4nv",
    "out_scales_ptr": "*fp32",
    "out_src_ptr": "*i32",
    "out_count_ptr": "*i32",
    "out_range_ptr": "*i64",
    "recv_stats_ptr": "*i32",
    "wait_stats_ptr": "*i64",
    "trace_ptr": "*i64",
    **LL_SHARED,
}
LL_COMBINE = {
    "x_ptr": "*bf16",
    "src_ptr": "*i32",
    "slot_ptr": "*i32",
    "range_ptr": "*i64",
    "topk_idx_ptr": "*i64",
    "topk_weights_ptr": "*fp32",
    "num_tokens": "i32",
    "out_ptr": "*bf16",
    "wait_stats_ptr": "*i64",
    "trace_ptr": "*i64",
    **LL_SHARED,
}
LL_DISPATCH_META = dict(
    H=7168,
    K=8,
    NUM_EXPERTS=256,
    NUM_RANKS=4,
    MAX_TOKENS=128,
    MSG_BYTES=7312,
    RECV_SET_BYTES=1 << 28,
    FLAG_SET_BYTES=2048,
    RECV_OFFSET=0,
    FLAG_OFFSET=1 << 29,
    STAGE_OFFSET=(1 << 29) + (1 << 26) + 4096,
    GPUS_PER_NODE=4,
    USE_FP8=True,
    USE_UE8M0=False,
    PACK_UE8M0=False,
    DO_SEND=True,
    DO_RECV=True,
    USE_CLOCK=True,
    BLOCK_N=128,
    COUNT_BY_ADDS=True,
    ONE_TOKEN=False,
    BLOCK_K=8,
    BLOCK_SCALES=64,
    BLOCK_RANKS=4,
    BINS=256,
    BLOCK_MSGS=8,
    BLOCK_ITEMS=2,
    PROFILE=False,
    WAIT_STATS=False,
    RECV_STATS=False,
    SHRINK=False,
    VIA=0,
)
LL_COMBINE_META = dict(
    H=7168,
    K=8,
    K_MAX=16,
    NUM_EXPERTS=256,
    NUM_RANKS=4,
    MAX_TOKENS=128,
    RECV_SET_BYTES=1 << 25,
    SLOT_BYTES=14784,
    RECV_OFFSET=(1 << 29) + 4096,
    DONE_OFFSET=(1 << 29) + (1 << 26) + 4096,
    STAGE_OFFSET=(1 << 29) + (1 << 26) + 4224,
    GPUS_PER_NODE=4,
    DO_SEND=True,
    DO_RECV=True,
    USE_CLOCK=True,
    BLOCK_SCALES=64,
    BLOCK_RANKS=4,
    BLOCK_ROWS=4,
    BLOCK_CHANNELS=8192,
    PROFILE=False,
    WAIT_STATS=False,
    SHRINK=False,
    VIA=0,
    LOGFMT=False,
    BLOCK_GROUPS=8,
)
# Hidden 2880 (gpt-oss): messages of 16 + 2880 + 23 * 4 bytes (FP8), slots of 23 groups.
H2880_DISPATCH = dict(H=2880, MSG_BYTES=2992, BLOCK_SCALES=32, BLOCK_MSGS=8)
H2880_COMBINE = dict(H=2880, SLOT_BYTES=6080, BLOCK_SCALES=32, BLOCK_GROUPS=32, BLOCK_CHANNELS=4096)
TRACED = dict(PROFILE=True, WAIT_STATS=True)
LOGFMT = dict(LOGFMT=True, BLOCK_ROWS=2, BLOCK_CHANNELS=4096, BLOCK_GROUPS=64)
for name, sig, meta in [
    ("ll_dispatch", LL_DISPATCH, LL_DISPATCH_META),
    ("ll_combine", LL_COMBINE, LL_COMBINE_META),
    ("ll_dispatch", LL_DISPATCH, {**LL_DISPATCH_META, **TRACED}),
    ("ll_combine", LL_COMBINE, {**LL_COMBINE_META, **TRACED}),
    # Scales packed as UE8M0 bytes (DeepEP's use_ue8m0), rows counted into a statistic
    (
        "ll_dispatch",
        {**LL_DISPATCH, "out_scales_ptr": "*i32"},
        {**LL_DISPATCH_META, "USE_UE8M0": True, "PACK_UE8M0": True, "RECV_STATS": True},
    ),
    # BF16 payloads
    (
        "ll_dispatch",
        {**LL_DISPATCH, "out_x_ptr": "*bf16", "out_scales_ptr": "*i32"},
        {**LL_DISPATCH_META, "USE_FP8": False, "BLOCK_MSGS": 4},
    ),
    # Across nodes, emulated (copies from the staging slabs)
    ("ll_dispatch", LL_DISPATCH, {**LL_DISPATCH_META, "VIA": 1}),
    ("ll_combine", LL_COMBINE, {**LL_COMBINE_META, "VIA": 1}),
    # Shrink mode (masked peers skipped, timeouts mask), within a node and across nodes
    ("ll_dispatch", LL_DISPATCH, {**LL_DISPATCH_META, "SHRINK": True}),
    ("ll_combine", LL_COMBINE, {**LL_COMBINE_META, "SHRINK": True}),
    ("ll_dispatch", LL_DISPATCH, {**LL_DISPATCH_META, "SHRINK": True, "VIA": 1}),
    ("ll_combine", LL_COMBINE, {**LL_COMBINE_META, "SHRINK": True, "VIA": 1}),
    # LogFMT combine (DeepEP's use_logfmt), within a node and across nodes
    ("ll_combine", LL_COMBINE, {**LL_COMBINE_META, **LOGFMT}),
    ("ll_combine", LL_COMBINE, {**LL_COMBINE_META, **LOGFMT, "VIA": 1}),
    # gpt-oss's hidden size, 2880: 23 groups of 128 channels, the last of 64 (FP8 with float32
    # or packed scales, BF16, LogFMT); and 200, whose FP8 rows (200 bytes) end off a 16-byte
    # boundary, so that the scales start at the next one.
    ("ll_dispatch", LL_DISPATCH, {**LL_DISPATCH_META, **H2880_DISPATCH}),
    (
        "ll_dispatch",
        {**LL_DISPATCH, "out_scales_ptr": "*i32"},
        {**LL_DISPATCH_META, **H2880_DISPATCH, "USE_UE8M0": True, "PACK_UE8M0": True},
    ),
    (
        "ll_dispatch",
        {**LL_DISPATCH, "out_x_ptr": "*bf16", "out_scales_ptr": "*i32"},
        {**LL_DISPATCH_META, **H2880_DISPATCH, "USE_FP8": False, "MSG_BYTES": 5776},
    ),
    (
        "ll_dispatch",
        LL_DISPATCH,
        {**LL_DISPATCH_META, "H": 200, "MSG_BYTES": 240, "BLOCK_SCALES": 2},
    ),
    ("ll_combine", LL_COMBINE, {**LL_COMBINE_META, **H2880_COMBINE}),
    ("ll_combine", LL_COMBINE, {**LL_COMBINE_META, **LOGFMT, **H2880_COMBINE}),
    # The other batch classes: one token, and ids counted by histograms (one item at a time)
    ("ll_dispatch", LL_DISPATCH, {**LL_DISPATCH_META, "ONE_TOKEN": True}),
    ("ll_dispatch", LL_DISPATCH, {**LL_DISPATCH_META, "COUNT_BY_ADDS": False, "BLOCK_ITEMS": 1}),
]:
    KERNELS.append(
        (
            f"tritonep.kernels.{name}",
            f"{name}_kernel",
            {**sig, **{k: "constexpr" for k in meta}},
            meta,
            # As launched: both kernels on 16 warps.
            {"enable_fp_fusion": False, "num_warps": 16}
            if name == "ll_combine"
            else {"num_warps": 16},
        )
    )

# The normal-mode kernels, their signatures from their argument bundles (as launched).
TYPES = {
    # shared (NormalShared, LayoutShared)
    "peer_ptrs": "*i64",
    "pe_ptr": "*i32",
    "rank": "i32",
    "state_ptr": "*i64",
    "status_ptr": "*i32",
    "timeout_us": "i32",
    "decoded_ptr": "*i32",
    "partial_ptr": "*i32",
    "arrivals_ptr": "*i32",
    # per call
    "counts_ptr": "*i1",
    "num_tokens": "i32",
    "num_rows": "i32",
    "own_start": "i32",
    "prefix_ptr": "*i32",
    "max_rows": "i32",
    "K": "i32",
    "chunk": "i32",
    "alignment": "i32",
    "per_expert_ptr": "*i32",
    "per_rank_ptr": "*i32",
    "extra_ptr": "*i32",
    "extra_out_ptr": "*i32",
    "recv_count_ptr": "*i32",
    "recv_start_ptr": "*i32",
    "host_info_ptr": "*i32",
    "trace_ptr": "*i64",
    "x_ptr": "*fp8e4nv",
    "scales_ptr": "*fp32",
    "topk_idx_ptr": "*i64",
    "topk_weights_ptr": "*fp32",
    "in_rank_ptr": "*i1",
    "src_tag_ptr": "*i32",
    "out_x_ptr": "*fp8e4nv",
    "out_scales_ptr": "*fp32",
    "out_topk_idx_ptr": "*i64",
    "out_weights_ptr": "*fp32",
    "out_src_ptr": "*i32",
    "bounds_ptr": "*i32",
    "ready_ptr": "*i32",
    "relay_call_ptr": "*i64",
    "row_map_ptr": "*i32",
    "weights_ptr": "*fp32",
    "bias0_ptr": "*bf16",
    "bias1_ptr": "*bf16",
    "out_ptr": "*bf16",
}


def _signature(call, shared, **types):
    return {name: types.get(name, TYPES[name]) for name in call._fields + shared._fields}


LAYOUT = _signature(layout.LayoutCall, layout.LayoutShared)
KERNELS.append(
    (
        "tritonep.kernels.layout",
        "dispatch_layout_kernel",
        {**LAYOUT, **{k: "constexpr" for k in layout.LayoutVariant._fields}},
        dict(
            NUM_EXPERTS=256,
            NUM_RANKS=4,
            BLOCK_TOKENS=64,
            BLOCK_K=8,
            BLOCK_RANKS=4,
            BLOCK_EXPERTS=256,
            BLOCK_PROGRAMS=16,
        ),
    )
)

# The copy-engine combine's sums (4 ranks, 4096 tokens a rank at most, both biases, weights).
for _later in (False, True):  # the first chunk's launch, then the others'
    KERNELS.append(
        (
            "tritonep.kernels.normal_copy_combine",
            "copy_combine_sum",
            {
                **_signature(
                    normal_copy_combine.SumCall,
                    normal_copy_combine.SumShared,
                    x_ptr="*bf16",
                ),
                **{k: "constexpr" for k in normal_copy_combine.SumVariant._fields},
            },
            dict(
                H=7168,
                NUM_RANKS=4,
                CAPACITY=4096,
                MAX_TOPK=16,
                DONE_OFFSET=32,
                ROWS_OFFSET=256,
                WEIGHTS_OFFSET=176160768 + 256,
                HAS_WEIGHTS=True,
                NUM_BIAS=2,
                CHUNKS=2,  # (the chunked path: the default of one has no chunk scan)
                LAST_SHARE=copy_combine.default_last_share(4),
                USE_CLOCK=True,
                BLOCK_TOKENS=(
                    copy_combine._BLOCK_TOKENS_LATER if _later else copy_combine._BLOCK_TOKENS
                )[True],  # (the GPU's configuration)
                BLOCK_WORDS=(
                    copy_combine._BLOCK_ELEMS_LATER if _later else copy_combine._BLOCK_ELEMS
                )[True]
                // 2,
                BLOCK_RANKS=4,
                BLOCK_K=8,
                X_ALIGNED=True,
                LATER=_later,
                STAGES=copy_combine._STAGES[True],
            ),
            {"num_warps": copy_combine._NUM_WARPS, "enable_fp_fusion": False},
        )
    )

# Each token's row at each rank, for those sums.
KERNELS.append(
    (
        "tritonep.kernels.normal_copy_combine",
        "copy_combine_prefix",
        {
            "in_rank_ptr": "*i1",
            "prefix_ptr": "*i32",
            "num_tokens": "i32",
            "NUM_RANKS": "constexpr",
            "CHUNKS": "constexpr",
            "LAST_SHARE": "constexpr",
            "BLOCK": "constexpr",
            "BLOCK_CHUNKS": "constexpr",
        },
        dict(
            NUM_RANKS=4,
            CHUNKS=2,
            LAST_SHARE=copy_combine.default_last_share(4),
            BLOCK=copy_combine._PREFIX_TOKENS[True],
            BLOCK_CHUNKS=2,
        ),
        {"num_warps": 4},
    )
)

# The slot dispatch prototype: 4 ranks, hidden 7168 as [28, 256] boxes of one row (TMA) or
# [16, 1024] tiles (plain stores).
_SLOTS = {
    "in_rank_ptr": "*i8",
    "plan_ptr": "*i32",
    "info_ptr": "*i32",
    "state_ptr": "*i64",
    "peer_ptrs": "*i64",
    "rank": "i32",
    "num_tokens": "i32",
    "max_rows": "i32",
    "arrivals_offset": "i64",
    "recv_offset": "i64",
    "status_ptr": "*i32",
    "timeout_us": "i32",
}
_SLOTS_DISPATCH = {k: v for k, v in _SLOTS.items() if k != "state_ptr"}
_SLOTS_META = dict(
    NUM_RANKS=4,
    HIDDEN=7168,
    BOXES=1,
    BOX_ROWS=32,
    STAGES=3,
    BLOCK_T=16,
    BLOCK_H=1024,
    BLOCK_TOKENS=1024,
    BLOCK_RANKS=4,
    USE_CLOCK=True,
    desc4=None,
    desc5=None,
    desc6=None,
    desc7=None,
)
_BOX = "tensordesc<bf16[1,32,256]>"
KERNELS += [
    (
        "tritonep.kernels.normal_slots",
        "slots_notify_kernel",
        {
            k: _SLOTS[k]
            for k in (
                "in_rank_ptr",
                "num_tokens",
                "peer_ptrs",
                "rank",
                "state_ptr",
                "info_ptr",
                "status_ptr",
                "timeout_us",
            )
        },
        dict(NUM_RANKS=4, USE_CLOCK=True, BLOCK_TOKENS=1024, BLOCK_RANKS=4),
    ),
    (
        "tritonep.kernels.normal_slots",
        "slots_dispatch_kernel",
        {**_SLOTS_DISPATCH, "x_desc": _BOX, **{f"desc{d}": _BOX for d in range(4)}},
        dict(_SLOTS_META, x_ptr=None, VIA_TMA=True),
        {"num_warps": 4},
    ),
    (
        "tritonep.kernels.normal_slots",
        "slots_dispatch_kernel",
        {**_SLOTS_DISPATCH, "x_ptr": "*bf16"},
        dict(
            _SLOTS_META, x_desc=None, desc0=None, desc1=None, desc2=None, desc3=None, VIA_TMA=False
        ),
        {"num_warps": 16},
    ),
    # Rotated destinations, streaming stores, [32, 1024] tiles on 32 warps.
    (
        "tritonep.kernels.normal_slots",
        "slots_dispatch_kernel",
        {**_SLOTS_DISPATCH, "x_ptr": "*bf16"},
        dict(
            _SLOTS_META,
            x_desc=None,
            desc0=None,
            desc1=None,
            desc2=None,
            desc3=None,
            VIA_TMA=False,
            BLOCK_T=32,
            ROTATE=True,
            STREAM=True,
        ),
        {"num_warps": 32},
    ),
]

# 4 ranks, hidden 7168, 256 experts, top-8, 12 channels of rings for 16, 128 slots a ring.
_LAYOUT = NormalLayout.of(7168, 4, 64, 8, 16, 128, staged=True, notify_extra=96)
NOTIFY = _signature(normal_notify.NotifyCall, normal_dispatch.NormalShared)
NOTIFY_META = dict(
    NUM_RANKS=4,
    NUM_CHANNELS=12,
    E_LOCAL=64,
    ROW_WORDS=_LAYOUT.notify_row,
    SET_BYTES=_LAYOUT.notify_set,
    NOTIFY_OFFSET=_LAYOUT.notify,
    STAGE_OFFSET=_LAYOUT.stage_notify,
    EXTRA=0,
    COUNTS_GIVEN=False,
    CHANNEL_MAJOR=False,
    HOST_COPY=False,
    USE_CLOCK=True,
    BLOCK_TOKENS=256,
    BLOCK_CHANNELS=16,
    BLOCK_EXPERTS=64,
    BLOCK_RANKS=4,
    BLOCK_EXTRA=2,
    BLOCK_ROW=128,
    PROFILE=False,
    VIA=0,
)
NORMAL_DISPATCH = _signature(normal_dispatch.DispatchCall, normal_dispatch.NormalShared)
NORMAL_DISPATCH_META = dict(
    ROW_WORDS=1792,
    SCALE_WORDS=56,
    E_LOCAL=64,
    NUM_RANKS=4,
    NUM_CHANNELS=12,
    MAX_CHANNELS=16,
    RING=128,
    RING_STRIDE=128,
    SLOT_BYTES=_LAYOUT.dispatch_slot,
    RECORD_WORD=1848,
    RING_OFFSET=_LAYOUT.dispatch_ring,
    TAIL_OFFSET=_LAYOUT.dispatch_tail,
    HEAD_OFFSET=_LAYOUT.dispatch_head,
    STAGE_OFFSET=_LAYOUT.stage_rings,
    HAS_SCALES=True,
    HAS_TOPK=True,
    HAS_WEIGHTS=True,
    HAS_TAG=False,
    PAD_ROWS=True,
    BOUNDS=False,
    AWAIT=False,
    RANKS_FROM_IDS=False,
    PUBLISH=False,
    LOCAL=True,
    ROW_MAP=False,
    RELEASE_STEPS=1,
    USE_CLOCK=True,
    BLOCK_TOKENS=8,
    BLOCK_ROWS=8,
    BLOCK_SEND_WORDS=512,
    BLOCK_RECV_WORDS=256,
    BLOCK_RANKS=4,
    BLOCK_K=8,
    BLOCK_SCALES=64,
    EXCHANGE=False,
    NOTIFY_ROW_WORDS=_LAYOUT.notify_row,
    NOTIFY_SET_BYTES=_LAYOUT.notify_set,
    NOTIFY_OFFSET=_LAYOUT.notify,
    NOTIFY_STAGE_OFFSET=_LAYOUT.stage_notify,
    BLOCK_COUNT_TOKENS=256,
    BLOCK_CHANNELS=16,
    BLOCK_EXPERTS=64,
    BLOCK_NOTIFY_ROW=512,
    PROFILE=False,
    VIA=0,
)
NORMAL_COMBINE = _signature(normal_combine.CombineCall, normal_dispatch.NormalShared, x_ptr="*bf16")
NORMAL_COMBINE_META = dict(
    H=7168,
    NUM_RANKS=4,
    NUM_CHANNELS=12,
    MAX_CHANNELS=16,
    RING=128,
    RING_STRIDE=128,
    SLOT_BYTES=_LAYOUT.combine_slot,
    RING_OFFSET=_LAYOUT.combine_ring,
    TAIL_OFFSET=_LAYOUT.combine_tail,
    HEAD_OFFSET=_LAYOUT.combine_head,
    STAGE_OFFSET=_LAYOUT.stage_rings,
    HAS_WEIGHTS=True,
    NUM_BIAS=2,
    BOUNDS=False,
    AWAIT=False,
    PUBLISH=False,
    LOCAL=True,
    X_ALIGNED=True,
    ROW_MAP=False,
    RELEASE_STEPS=1,
    USE_CLOCK=True,
    BLOCK_TOKENS=8,
    BLOCK_ROWS=8,
    BLOCK_WORDS=512,
    BLOCK_RANKS=4,
    BLOCK_K=8,
    PROFILE=False,
    VIA=0,
)
# As the normal mode launches them (4 ranks).
DISPATCH_OPTIONS = {"num_warps": DISPATCH_WARPS}
COMBINE_OPTIONS = {"num_warps": COMBINE_WARPS, "enable_fp_fusion": False}
NORMAL_BF16 = {"x_ptr": "*bf16", "out_x_ptr": "*bf16"}
for module, name, sig, meta, options in [
    ("normal_notify", "notify_kernel", NOTIFY, NOTIFY_META, {}),
    (
        "normal_dispatch",
        "normal_dispatch_kernel",
        NORMAL_DISPATCH,
        NORMAL_DISPATCH_META,
        DISPATCH_OPTIONS,
    ),
    (
        "normal_combine",
        "normal_combine_kernel",
        NORMAL_COMBINE,
        NORMAL_COMBINE_META,
        COMBINE_OPTIONS,
    ),
    ("normal_notify", "notify_kernel", NOTIFY, {**NOTIFY_META, "PROFILE": True}, {}),
    (
        "normal_dispatch",
        "normal_dispatch_kernel",
        NORMAL_DISPATCH,
        {**NORMAL_DISPATCH_META, "PROFILE": True},
        DISPATCH_OPTIONS,
    ),
    (
        "normal_combine",
        "normal_combine_kernel",
        NORMAL_COMBINE,
        {**NORMAL_COMBINE_META, "PROFILE": True},
        COMBINE_OPTIONS,
    ),
    # An exact-size first dispatch's notify: the count also goes to host memory
    ("normal_notify", "notify_kernel", NOTIFY, {**NOTIFY_META, "HOST_COPY": True}, {}),
    # A worst-case first dispatch: the count exchange in the same launch
    (
        "normal_dispatch",
        "normal_dispatch_kernel",
        NORMAL_DISPATCH,
        {**NORMAL_DISPATCH_META, "EXCHANGE": True},
        DISPATCH_OPTIONS,
    ),
    (
        "normal_dispatch",
        "normal_dispatch_kernel",
        {**NORMAL_DISPATCH, **NORMAL_BF16},
        {
            **NORMAL_DISPATCH_META,
            "EXCHANGE": True,
            "PROFILE": True,
            "ROW_WORDS": 3584,
            "SCALE_WORDS": 0,
            "HAS_SCALES": False,
            "RECORD_WORD": 3584,
            "BLOCK_SCALES": 2,
        },
        DISPATCH_OPTIONS,
    ),
    # BF16 payloads, cached (no ids), exact size
    (
        "normal_dispatch",
        "normal_dispatch_kernel",
        {**NORMAL_DISPATCH, **NORMAL_BF16},
        {
            **NORMAL_DISPATCH_META,
            "ROW_WORDS": 3584,
            "SCALE_WORDS": 0,
            "HAS_SCALES": False,
            "HAS_TOPK": False,
            "HAS_WEIGHTS": False,
            "PAD_ROWS": False,
            "RECORD_WORD": 3584,
            "BLOCK_SCALES": 2,
        },
        DISPATCH_OPTIONS,
    ),
    # A combine input off a 16-byte boundary: own rows read from x by pointer
    (
        "normal_combine",
        "normal_combine_kernel",
        NORMAL_COMBINE,
        {**NORMAL_COMBINE_META, "X_ALIGNED": False},
        COMBINE_OPTIONS,
    ),
    # The staged transport of the internode rail leg (copies from the mirror rings)
    ("normal_notify", "notify_kernel", NOTIFY, {**NOTIFY_META, "VIA": 1}, {}),
    (
        "normal_dispatch",
        "normal_dispatch_kernel",
        NORMAL_DISPATCH,
        {**NORMAL_DISPATCH_META, "VIA": 1},
        DISPATCH_OPTIONS,
    ),
    (
        "normal_combine",
        "normal_combine_kernel",
        NORMAL_COMBINE,
        {**NORMAL_COMBINE_META, "VIA": 1},
        COMBINE_OPTIONS,
    ),
    # The relay between the internode legs: the network leg flags the rows it writes (and
    # its notify carries the forwarding counts); the NVLink leg waits for them.
    (
        "normal_notify",
        "notify_kernel",
        NOTIFY,
        {**NOTIFY_META, "VIA": 1, "EXTRA": 96, "BLOCK_EXTRA": 128, "CHANNEL_MAJOR": True},
        {},
    ),
    (
        "normal_notify",
        "notify_kernel",
        {**NOTIFY, "counts_ptr": "*i32"},
        {**NOTIFY_META, "COUNTS_GIVEN": True},
        {},
    ),
    (
        "normal_dispatch",
        "normal_dispatch_kernel",
        NORMAL_DISPATCH,
        {**NORMAL_DISPATCH_META, "VIA": 1, "HAS_TAG": True, "PUBLISH": True},
        DISPATCH_OPTIONS,
    ),
    (
        "normal_dispatch",
        "normal_dispatch_kernel",
        NORMAL_DISPATCH,
        {
            **NORMAL_DISPATCH_META,
            "HAS_TAG": True,
            "BOUNDS": True,
            "AWAIT": True,
            "RANKS_FROM_IDS": True,
            "LOCAL": False,
        },
        DISPATCH_OPTIONS,
    ),
    # A cached NVLink leg writing rows at their final positions (ROW_MAP)
    (
        "normal_dispatch",
        "normal_dispatch_kernel",
        NORMAL_DISPATCH,
        {
            **NORMAL_DISPATCH_META,
            "HAS_TOPK": False,
            "HAS_WEIGHTS": False,
            "HAS_TAG": True,
            "BOUNDS": True,
            "AWAIT": True,
            "LOCAL": False,
            "ROW_MAP": True,
        },
        DISPATCH_OPTIONS,
    ),
    (
        "normal_combine",
        "normal_combine_kernel",
        NORMAL_COMBINE,
        {**NORMAL_COMBINE_META, "BOUNDS": True, "PUBLISH": True, "LOCAL": False},
        COMBINE_OPTIONS,
    ),
    # The NVLink leg reading its input in the caller's order (ROW_MAP)
    (
        "normal_combine",
        "normal_combine_kernel",
        NORMAL_COMBINE,
        {**NORMAL_COMBINE_META, "BOUNDS": True, "PUBLISH": True, "LOCAL": False, "ROW_MAP": True},
        COMBINE_OPTIONS,
    ),
    (
        "normal_combine",
        "normal_combine_kernel",
        NORMAL_COMBINE,
        {**NORMAL_COMBINE_META, "VIA": 1, "AWAIT": True, "BLOCK_ROWS": 4, "LOCAL": False},
        COMBINE_OPTIONS,
    ),
    # Senders that release their tails every few steps (SEND_RELEASE_STEPS)
    (
        "normal_dispatch",
        "normal_dispatch_kernel",
        NORMAL_DISPATCH,
        {**NORMAL_DISPATCH_META, "RELEASE_STEPS": 2},
        DISPATCH_OPTIONS,
    ),
    (
        "normal_dispatch",
        "normal_dispatch_kernel",
        NORMAL_DISPATCH,
        {**NORMAL_DISPATCH_META, "VIA": 1, "RELEASE_STEPS": 4, "LOCAL": False},
        DISPATCH_OPTIONS,
    ),
    (
        "normal_combine",
        "normal_combine_kernel",
        NORMAL_COMBINE,
        {**NORMAL_COMBINE_META, "RELEASE_STEPS": 2},
        COMBINE_OPTIONS,
    ),
    # gpt-oss's hidden size, 2880: FP8 rows of 720 words and 23 scale words
    (
        "normal_dispatch",
        "normal_dispatch_kernel",
        NORMAL_DISPATCH,
        {
            **NORMAL_DISPATCH_META,
            "ROW_WORDS": 720,
            "SCALE_WORDS": 23,
            "BLOCK_SCALES": 32,
            "SLOT_BYTES": 5936,
            "RECORD_WORD": 744,
            "BLOCK_SEND_WORDS": 512,
            "BLOCK_RECV_WORDS": 256,
        },
        DISPATCH_OPTIONS,
    ),
    (
        "normal_combine",
        "normal_combine_kernel",
        NORMAL_COMBINE,
        {**NORMAL_COMBINE_META, "H": 2880, "SLOT_BYTES": 5792},
        COMBINE_OPTIONS,
    ),
]:
    KERNELS.append(
        (
            f"tritonep.kernels.{module}",
            name,
            {**sig, **{k: "constexpr" for k in meta}},
            meta,
            options,
        )
    )

FP8_QUANTIZE = {"x_ptr": "*bf16", "q_ptr": "*u8", "scale_ptr": "*fp32", "x_stride": "i32"}
FP8_DEQUANTIZE = {
    "q_ptr": "*u8",
    "scale_ptr": "*fp32",
    "out_ptr": "*bf16",
    "num_tokens": "i32",
    "q_batch_stride": "i32",
    "q_stride": "i32",
    "scale_batch_stride": "i32",
    "scale_stride": "i32",
    "scale_group_stride": "i32",
}
# The public quantize_fp8 and dequantize_fp8 at 7168 and at gpt-oss's 2880 (a partial group).
for hidden, g_p2 in [(7168, 64), (2880, 32)]:
    KERNELS += [
        (
            "tritonep.kernels.fp8",
            "quantize_fp8_kernel",
            {
                **FP8_QUANTIZE,
                **dict.fromkeys(
                    ("H", "BLOCK_GROUPS", "USE_UE8M0", "IS_BF16", "EMULATE"), "constexpr"
                ),
            },
            dict(H=hidden, BLOCK_GROUPS=g_p2, USE_UE8M0=False, IS_BF16=True, EMULATE=False),
            {"num_warps": 8},
        ),
        (
            "tritonep.kernels.fp8",
            "dequantize_fp8_kernel",
            {
                **FP8_DEQUANTIZE,
                **dict.fromkeys(("H", "BLOCK_GROUPS", "TO_BF16", "EMULATE"), "constexpr"),
            },
            dict(H=hidden, BLOCK_GROUPS=g_p2, TO_BF16=True, EMULATE=False),
            {"num_warps": 8},
        ),
    ]

COMPILE = """
import importlib, inspect, json, sys, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tritonep.kernels.nvshmem import _holds_device_state


def compile_ptx(module, name, signature, constexprs, options):
    kernel = getattr(importlib.import_module(module), name)
    # Constexprs left out take their defaults, as a launch fills them in (Triton 3.9 wants
    # each).
    for p in kernel.params:
        given = p.name in signature or p.name in constexprs
        if not given and p.default is not inspect.Parameter.empty:
            constexprs[p.name] = getattr(p.default, "value", p.default)
    signature = {p.name: signature.get(p.name, "constexpr") for p in kernel.params}
    hopper = GPUTarget("cuda", 90, 32)
    # As at launch: pointers (and byte offsets) are specialized as multiples of 16.
    aligned = [i for i, (k, v) in enumerate(signature.items())
               if v.startswith("*") or "offset" in k]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(source, target=hopper, options=options)
    assert compiled.asm["cubin"]
    # A kernel loaded from a cache of binaries only: is it still seen to need NVSHMEM's state?
    state = _holds_device_state({"cubin": compiled.asm["cubin"]})
    return compiled.asm["ptx"] + f"\\n// cubin holds the device state: {state}\\n"


results = []
for job in json.load(sys.stdin):
    try:
        results.append({"ptx": compile_ptx(*job)})
    except Exception:
        results.append({"error": traceback.format_exc()})
json.dump(results, sys.stdout)
"""


def _job(module, name, signature, constexprs, options=None) -> list:
    return [module, name, signature, constexprs, options or {}]


def _compile(jobs: list[list]) -> dict[str, dict]:
    """Compile ``jobs`` in one process (which pays the imports once): ``{job as JSON: {"ptx":
    text} or {"error": traceback}}``."""
    # Compiled, not interpreted, even without a GPU (importing tritonep keeps an explicit 0).
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(sys.path))
    command = [sys.executable, "-c", COMPILE]
    limit = 300 + 60 * len(jobs)
    proc = subprocess.run(
        command, input=json.dumps(jobs), capture_output=True, text=True, env=env, timeout=limit
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(map(json.dumps, jobs), json.loads(proc.stdout), strict=True))


@functools.cache
def _compiled_kernels() -> dict[str, dict]:
    """Every variant of :data:`KERNELS`, compiled together the first time one is asked for."""
    return _compile([_job(*kernel) for kernel in KERNELS])


def compile_ptx(module, name, signature, constexprs, options=None) -> str:
    """The PTX of a kernel variant compiled for sm_90 (and whether its cubin holds NVSHMEM's
    device state, as a last comment line)."""
    key = json.dumps(_job(module, name, signature, constexprs, options))
    result = _compiled_kernels().get(key) or _compile([json.loads(key)])[key]
    assert "ptx" in result, result["error"][-3000:]
    return result["ptx"]


RELAY = ("BOUNDS", "AWAIT", "PUBLISH", "COUNTS_GIVEN", "EXTRA")


def _id(kernel):
    meta = kernel[3]
    relay = (
        "-relay-" + "-".join(k.lower() for k in RELAY if meta.get(k))
        if any(meta.get(k) for k in RELAY)
        else ""
    )
    traced = "-traced" if meta.get("PROFILE", False) else ""
    shrink = "-shrink" if meta.get("SHRINK") else ""
    packed = "-ue8m0" if meta.get("PACK_UE8M0") else ""
    packed += "-logfmt" if meta.get("LOGFMT") else ""
    packed += "-bf16" if meta.get("USE_FP8") is False else ""
    packed += f"-release{meta['RELEASE_STEPS']}" if meta.get("RELEASE_STEPS", 1) > 1 else ""
    packed += f"-h{meta['H']}" if meta.get("H", 7168) != 7168 else ""
    packed += "-h2880" if meta.get("ROW_WORDS") == 720 else ""
    packed += "-one-token" if meta.get("ONE_TOKEN") else ""
    packed += "-exchange" if meta.get("EXCHANGE") else ""
    packed += "-unaligned-x" if meta.get("X_ALIGNED") is False else ""
    packed += "-host-copy" if meta.get("HOST_COPY") else ""
    packed += "-later" if meta.get("LATER") else ""
    packed += "-histograms" if meta.get("COUNT_BY_ADDS") is False else ""
    packed += "-tma" if meta.get("VIA_TMA") else ""
    packed += "-rotated-streaming" if meta.get("ROTATE") and meta.get("STREAM") else ""
    return kernel[1] + traced + ("-staged" if meta.get("VIA") else "") + shrink + packed + relay


@pytest.mark.parametrize("kernel", KERNELS, ids=[_id(k) for k in KERNELS])
def test_compiles_for_sm90(kernel):
    assert ".target sm_90" in compile_ptx(*kernel)


@pytest.mark.parametrize("name", ["normal_combine_kernel", "copy_combine_sum"])
def test_combine_sums_read_rows_in_16_byte_vectors(name):
    """The sums of the combine (the rings' receivers and the copy engines') load every row,
    the peers' and this rank's own in x, 16 bytes an instruction (not a BF16 value: the own
    rows' pointer once chosen by ``tl.where`` beside the ring slot's or the region's hid the
    alignment of both); the copy engines' sums, which load blocks ahead, through 16-byte
    asynchronous copies into shared memory."""
    variants = [
        k
        for k in KERNELS
        if k[1] == name and k[3].get("LOCAL", True) and k[3].get("X_ALIGNED", True)
    ]
    assert variants
    for kernel in variants:
        ptx = compile_ptx(*kernel)
        if (kernel[3].get("STAGES") or 1) > 1:
            assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10", ptx)
        else:
            assert "ld.global.cg.v4.b32" in ptx
        assert not re.search(r"ld\.global[.\w]*\.b16", ptx)
        assert "fma.rn.f32" not in ptx  # sums only, as the reference adds


def test_low_latency_payload_moves_in_16_byte_vectors():
    dispatch, combine = compile_ptx(*KERNELS[2]), compile_ptx(*KERNELS[3])
    assert "st.global.v4.b32" in dispatch  # FP8 payload stores into the peer
    # ... and none a byte at a time: the payload's address is a message's plus a constant,
    # whose alignment only holds through Triton's rewrites as sync.aligned_ptr states it
    assert "st.global.b8" not in dispatch
    bf16 = compile_ptx(
        *next(k for k in KERNELS if k[1] == "ll_dispatch_kernel" and k[3].get("USE_FP8") is False)
    )
    assert "st.global.v4.b32" in bf16 and "st.global.b16" not in bf16
    assert "cvt.rn.satfinite.e4m3x2.f32" in dispatch  # hardware e4m3 conversion on GPUs
    assert "div.rn.f32" in dispatch  # IEEE division for the scales, as the reference
    assert "st.global.v4.b32" in combine and "ld.global.cg.v4.b32" in combine
    assert "fma.rn.f32" not in combine  # no fused multiply-add: bit-exact with the reference


def test_a_partial_group_keeps_16_byte_vectors():
    """At gpt-oss's 2880 channels (FP8 rows of 180 x 16 bytes, BF16 rows of 360) the rows
    still move in 16-byte vectors: the channel masks of a partial last group hold over every
    16 channels."""
    dispatch, combine = (
        compile_ptx(*next(k for k in KERNELS if k[1] == f"{name}_kernel" and k[3] == meta))
        for name, meta in (
            ("ll_dispatch", {**LL_DISPATCH_META, **H2880_DISPATCH}),
            ("ll_combine", {**LL_COMBINE_META, **H2880_COMBINE}),
        )
    )
    assert "st.global.v4.b32" in dispatch and "cvt.rn.satfinite.e4m3x2.f32" in dispatch
    assert "st.global.v4.b32" in combine and "ld.global.cg.v4.b32" in combine


def test_logfmt_combine_keeps_each_group_within_a_warp():
    """LogFMT's group reductions and high-bit packing and unpacking stay in registers and
    shuffles: they add few shared-memory round trips to the BF16 combine's. A layout that
    spreads a group over warps, as the first version's did (86 shared stores against 13),
    makes every group a barrier-bound chain and the combine 5x slower."""
    plain, logfmt = (
        compile_ptx(*next(k for k in KERNELS if k[1] == "ll_combine_kernel" and k[3] == meta))
        for meta in (LL_COMBINE_META, {**LL_COMBINE_META, **LOGFMT})
    )
    assert logfmt.count("st.shared") <= plain.count("st.shared") + 16
    assert "lg2.approx.f32" in logfmt  # the hardware logarithm, as DeepEP's


def test_flags_use_system_scope_release_and_acquire():
    assert "atom.global.sys.release.exch.b32" in compile_ptx(*KERNELS[0])
    ptx = compile_ptx(*KERNELS[1])
    assert "ld.global.sys.acquire.b32" in ptx  # atomic_add(p, 0, acquire) becomes an acquire load
    assert "%globaltimer" in ptx


def test_a_dispatch_that_exchanges_counts_waits_for_its_layout_at_gpu_scope():
    """The receivers of a worst-case first dispatch wait for the layout that its senders'
    count exchange releases (GPU scope: the same launch); without the exchange neither that
    release nor the wait is compiled in."""
    variants = [k for k in KERNELS if k[1] == "normal_dispatch_kernel"]
    fused = compile_ptx(*next(k for k in variants if k[3]["EXCHANGE"]))
    plain = compile_ptx(*variants[0])
    release = re.compile(r"atom\.global\.gpu\.release\.exch\.b64")
    acquire = re.compile(r"(ld|atom)\.global\.gpu\.acquire(\.add)?\.[bu]64")
    # (Both release the launch's call counter at their end: receivers wait for it.)
    assert len(release.findall(fused)) > len(release.findall(plain)) > 0
    assert acquire.search(fused) and not acquire.search(plain)
    # The count exchange's own waits: its peers' rows, read volatile and bounded by the clock.
    assert fused.count("%globaltimer") > plain.count("%globaltimer")


def test_an_exact_size_notify_writes_the_count_to_the_host_flag_last():
    """An exact-size notify stores the count into host memory, then (after a system-scope
    fence) the flag the host polls; without ``HOST_COPY`` only the fences of the status
    records are compiled in."""
    notifies = [k for k in KERNELS if k[1] == "notify_kernel" and not k[3]["PROFILE"]]
    host_copy = compile_ptx(*next(k for k in notifies if k[3]["HOST_COPY"]))
    plain = compile_ptx(*notifies[0])
    assert host_copy.count("fence.sc.sys") == plain.count("fence.sc.sys") + 1


def _clock_loops(ptx: str, source: str) -> list[str]:
    """The text of each loop of ``ptx`` (its innermost blocks, by LLVM's loop comments) that
    reads the clock and holds code of ``source`` (``file.py:line:``)."""
    blocks: dict[str, list[str]] = {}
    members: dict[str, list[str]] = {}
    name = None
    for line in ptx.splitlines():
        # A block starts at a label or, falling through, at LLVM's "// %bb.N:" comment.
        label = re.match(r"^(?:\$(L__BB\d+_\d+):|// (%bb\.\d+):)", line)
        if label:
            name = label.group(1) or label.group(2)
            blocks[name] = []
        if name is None:
            continue
        if len(blocks[name]) < 3:  # the label's comments (a nested loop's header: three)
            if "Loop Header" in line:
                members.setdefault(name, []).append(name)
            header = re.search(r"in Loop: Header=BB(\d+_\d+)", line)
            if header:
                members.setdefault("L__BB" + header.group(1), []).append(name)
        blocks[name].append(line)
    loops = ["\n".join("\n".join(blocks[b]) for b in set(bs)) for bs in members.values()]
    return [text for text in loops if "%globaltimer" in text and source in text]


def test_the_notify_wait_is_left_by_every_thread_at_once():
    """The wait for a peer's notify row (the notify launch, 4 warps, and the dispatch that
    folds the exchange in, 16) reads each word of the row in one thread, one 32-bit load, and
    decides to wait on through shared memory, a reduction over every warp: no warp can leave
    it before another and zero the row that one still waits for."""
    lines, first = inspect.getsourcelines(normal_notify.notify_receive.fn)
    wait = first + next(i for i, line in enumerate(lines) if line.lstrip().startswith("while"))
    notify = next(k for k in KERNELS if k[1] == "notify_kernel" and k[3]["HOST_COPY"])
    fused = next(k for k in KERNELS if k[1] == "normal_dispatch_kernel" and k[3]["EXCHANGE"])
    for kernel in (notify, fused):
        loops = _clock_loops(compile_ptx(*kernel), f"normal_notify.py:{wait}:")
        assert len(loops) == 1, kernel[1]
        loads = re.findall(r"ld\.volatile\.global\.(\S+)", loops[0])
        assert loads == ["b32"], (kernel[1], loads)
        assert "st.shared" in loops[0] and "bar.sync" in loops[0], kernel[1]


def _clock_checks(ptx: str, kernel) -> tuple[int, int]:
    """How many waits of ``ptx`` compare the clock with their limit and give every thread
    that answer through shared memory, a reduction over every warp (sync.keep_waiting), and
    how many loops read the clock without holding a barrier at all (each thread waits on its
    own and the first barrier after the loop gathers them)."""
    checks = own = 0
    for loop in _clock_loops(ptx, ""):
        if "bar.sync" not in loop:
            own += 1
            continue
        lines = [
            line
            for line in loop.splitlines()
            if not line.strip().startswith((".loc", "//", "$L__tmp"))
        ]
        for i, line in enumerate(lines):
            read = re.search(r"mov\.u64 (%rd\d+), %globaltimer", line)
            if not read or not re.search(
                rf"sub\.s64\s+%rd\d+, {re.escape(read.group(1))},", "\n".join(lines[i : i + 4])
            ):
                continue
            after = "\n".join(lines[i : i + 25])
            assert "st.shared" in after and "bar.sync" in after, (kernel[1], _id(kernel))
            assert "redux.sync" in after or "shfl.sync" in after, (kernel[1], _id(kernel))
            checks += 1
    return checks, own


def test_every_wait_leaves_at_one_clock_reading_on_every_thread():
    """Each thread reads its own clock; where a wait compares it with its limit, either the
    answer goes through shared memory, a reduction over every warp (sync.keep_waiting), so
    that no warp leaves a wait a read before another and their barriers stay in step, or the
    wait's loop holds no barrier at all (sync.wait_all_at_least on flags within one warp:
    each thread waits on its own and the first barrier after the loop gathers them).
    (Readings that only start a wait's clock, and traces, compare nothing.)"""
    checks = own = 0
    for kernel in KERNELS:
        if kernel[3].get("PROFILE") or kernel[3].get("WAIT_STATS"):
            continue
        counted = _clock_checks(compile_ptx(*kernel), kernel)
        checks += counted[0]
        own += counted[1]
    assert checks > 40, checks
    assert own > 10, own


def test_a_wait_on_flags_beyond_one_warp_leaves_at_one_clock_reading():
    """Flags spanning more than a warp's 32 lanes (an elastic barrier of 64 ranks; a
    low-latency dispatch's counts from 16 ranks, 4 experts a program) are checked through
    shared memory on every read, so their waits cannot poll on each thread alone: each
    leaves at one clock reading, and none of their loops is barrier-free."""
    wide = [
        (
            "tritonep.kernels.ll_dispatch",
            "ll_dispatch_kernel",
            {**LL_DISPATCH, **{k: "constexpr" for k in LL_DISPATCH_META}},
            {
                **LL_DISPATCH_META,
                **dict(NUM_RANKS=16, BLOCK_RANKS=16, BLOCK_ITEMS=4, GPUS_PER_NODE=8, VIA=1),
            },
            {"num_warps": 16},
        ),
        (
            "tritonep.kernels.elastic_exchange",
            "elastic_barrier",
            {
                "peer_ptrs": "*i64",
                "rank": "i32",
                **dict.fromkeys(("header_offset", "barrier_offset", "region_offset"), "i64"),
                "region_bytes": "i64",
                "state_ptr": "*i64",
                "status_ptr": "*i32",
                "timeout_us": "i32",
                **{k: "constexpr" for k in elastic_exchange.BarrierVariant._fields},
            },
            dict(NUM_RANKS=64, BLOCK_RANKS=64, USE_CLOCK=True),
            {"num_warps": 4},
        ),
    ]
    for kernel in wide:
        checks, own = _clock_checks(compile_ptx(*kernel), kernel)
        assert checks > 0 and own == 0, (kernel[1], checks, own)


def _kernel(name):
    return next(k for k in KERNELS if k[1] == name)


def test_traces_are_compiled_out_when_off():
    plain = [compile_ptx(*KERNELS[i]) for i in (2, 3)]
    traced = [compile_ptx(*KERNELS[i]) for i in (4, 5)]
    # The per-peer wait statistics: an atomic add whose result is unused (a reduction, "red",
    # from Triton 3.9 on).
    statistics = re.compile(r"(atom|red)\.global\.gpu\.relaxed\.add\.u64")
    for off, on in zip(plain, traced, strict=True):
        # Off: the clock is read only for the bounded waits, and no statistics are added.
        assert not statistics.search(off)
        assert statistics.search(on)
        assert on.count("%globaltimer") > off.count("%globaltimer")


def test_shrink_mode_is_compiled_out_when_off():
    shrink = [k for k in KERNELS if k[3].get("SHRINK") and not k[3].get("VIA")]
    for plain, masked in zip((KERNELS[2], KERNELS[3]), shrink, strict=True):
        off, on = compile_ptx(*plain), compile_ptx(*masked)
        assert "atom.global.acq_rel.gpu.cas.b64" in on  # the verdicts, one per peer and call
        assert "cas.b64" not in off


def _nvshmem_device_library():
    """NVSHMEM's device bitcode, where this machine has it (GPU machines do)."""
    dirs = [os.environ.get("NVSHMEM_LIB_DIR", "")]
    try:
        import nvidia.nvshmem

        dirs += [os.path.join(p, "lib") for p in nvidia.nvshmem.__path__]
    except ImportError:
        pass
    for d in filter(None, dirs):
        path = os.path.join(d, "libnvshmem_device.bc")
        if os.path.exists(path):
            return path
    pytest.skip("NVSHMEM's device library is not installed (set NVSHMEM_LIB_DIR)")


@pytest.mark.parametrize(
    "name",
    [
        "ll_dispatch_kernel",
        "ll_combine_kernel",
        "notify_kernel",
        "normal_dispatch_kernel",
        "normal_combine_kernel",
    ],
)
def test_staged_kernels_put_to_other_nodes_with_nvshmem(name):
    module, kernel, signature, meta, options = next(
        k for k in KERNELS if k[1] == name and k[3].get("VIA") == 1
    )
    options = {**options, "extern_libs": [["libnvshmem_device", _nvshmem_device_library()]]}
    ptx = compile_ptx(module, kernel, signature, {**meta, "VIA": 2}, options)
    assert ".target sm_90" in ptx and "nvshmem" in ptx  # NVSHMEM's puts, linked in
    # What the launch hook looks for before it initializes the module for NVSHMEM, in the PTX
    # and in the binary alone.
    assert _DEVICE_STATE in ptx
    assert "// cubin holds the device state: True" in ptx


@pytest.mark.parametrize("name", ["ll_dispatch_kernel", "ll_combine_kernel"])
def test_receive_only_launches_need_no_nvshmem(name):
    """A hook's receive launch puts nothing: it compiles without NVSHMEM's library, so no
    module of it is initialized for NVSHMEM (which would fail)."""
    module, kernel, signature, meta, options = next(
        k for k in KERNELS if k[1] == name and k[3].get("VIA") == 1
    )
    meta = {**meta, "VIA": 2, "DO_SEND": False, "DO_RECV": True}
    ptx = compile_ptx(module, kernel, signature, meta, options)
    assert ".target sm_90" in ptx and "nvshmem" not in ptx


def test_nvshmem_put_links_nvshmems_device_library():
    signature = {
        "src_ptr": "*i32",
        "nbytes": "i64",
        "peer_ptrs": "*i64",
        "rank": "i32",
        "pe": "i32",
        "data_offset": "i64",
        "flag_offset": "i64",
        "value": "i32",
    }
    options = {"extern_libs": [["libnvshmem_device", _nvshmem_device_library()]]}
    ptx = compile_ptx(
        "tritonep.kernels.put_signal", "put_signal_nvshmem_kernel", signature, {}, options
    )
    assert ".target sm_90" in ptx
    # The put and its signal come from NVSHMEM's library, linked into the kernel.
    assert "nvshmemx_putmem_signal_block" in ptx and "nvshmemi_transfer_put_signal" in ptx
    # NVSHMEM_SIGNAL_SET is a store into the signal word: a ``sig_op`` value that NVSHMEM
    # does not know (0 was passed here once) is folded into an atomic addition instead.
    assert "nvshmemi_transfer_amo_nonfetch" not in ptx


@triton.jit
def staged_copy_kernel(src_ptr, dst_ptr, nbytes):
    copy_bytes(dst_ptr.to(tl.int64, bitcast=True), src_ptr.to(tl.int64, bitcast=True), nbytes)


def test_staged_copies_move_16_byte_vectors():
    """The emulated network leg copies a byte count known only at run time: its accesses stay
    16-byte vectors (they were split into words once, a third of the rate)."""
    signature = {"src_ptr": "*i32", "dst_ptr": "*i32", "nbytes": "i64"}
    ptx = compile_ptx(__name__, "staged_copy_kernel", signature, {}, {"num_warps": 16})
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert "ld.global.b32" not in ptx and "st.global.b32" not in ptx


PARAM_FLAGS = """
import importlib, json, sys
flags = {}
for module, name in json.loads(sys.argv[1]):
    for p in getattr(importlib.import_module(module), name).params:
        flags[f"{name}.{p.name}"] = [p.is_const, not p.do_not_specialize,
                                     not p.do_not_specialize_on_alignment]
print(json.dumps(flags))
"""


@functools.cache
def _param_flags() -> dict:
    """How Triton's binder treats each parameter of every kernel here (``name.param`` ->
    its specialization flags), read once in a process without the interpreter."""
    # Compiled, not interpreted, even without a GPU (importing tritonep keeps an explicit 0).
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(sys.path))
    kernels = sorted({(k[0], k[1]) for k in KERNELS})
    proc = subprocess.run(
        [sys.executable, "-c", PARAM_FLAGS, json.dumps(kernels)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def triton_specializations(name, param, values):
    """How Triton's binder types and specializes ``values`` of parameter ``param``."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    flags = _param_flags()[f"{name}.{param}"]
    return [list(native_specialize_impl(BaseBackend, v, *flags)) for v in values]


WAITING_KERNELS = sorted({k[1] for k in KERNELS if "timeout_us" in k[2]})


@pytest.mark.parametrize("name", WAITING_KERNELS)
def test_a_new_limit_compiles_nothing(name):
    """Every limit reaches the kernels as the same unspecialized int32, so assigning
    ``timeout_s`` (e.g. from 60 s down to 2 s once every variant is warm) reuses the compiled
    variants. In nanoseconds, 2 s would be an int32 and 60 s an int64: new variants compiled
    while the peers wait (under a 2 s limit, long enough to mask a live peer)."""
    from tritonep.kernels.sync import MAX_TIMEOUT_S, timeout_us

    limits = [timeout_us(s) for s in (1e-6, 0.5, 1.0, 2.0, 60.0, 100.0, MAX_TIMEOUT_S)]
    assert limits[:2] == [1, 500_000] and limits[-1] == 2**31 - 1
    assert triton_specializations(name, "timeout_us", limits) == [["i32", None]] * 7


@pytest.mark.parametrize("name", ["ll_dispatch", "ll_combine"])
def test_a_new_batch_size_compiles_nothing_in_low_latency_mode(name):
    """Decode batches change size from step to step: no batch size (one token, a multiple of
    16) may compile a variant of its own while the peers wait, beyond the batch classes the
    host picks as constexprs (test_call_path)."""
    got = triton_specializations(f"{name}_kernel", "num_tokens", [0, 1, 2, 4, 16, 17, 128, 256])
    assert got == [["i32", None]] * 8


@pytest.mark.parametrize(
    "name, param",
    [
        ("notify_kernel", "num_tokens"),
        ("notify_kernel", "max_rows"),
        ("notify_kernel", "alignment"),
        ("normal_dispatch_kernel", "num_tokens"),
        ("normal_dispatch_kernel", "max_rows"),
        ("normal_dispatch_kernel", "alignment"),
        ("normal_combine_kernel", "num_tokens"),
        ("normal_combine_kernel", "num_rows"),
        ("dispatch_layout_kernel", "num_tokens"),
    ],
)
def test_a_new_token_count_compiles_nothing_in_normal_mode(name, param):
    """Token and row counts (one token, a multiple of 16, any other) and the alignment reach
    the normal-mode kernels unspecialized: after 4096 tokens, 128 and 1000 tokens once
    compiled variants of their own (4.1 and 3.7 s) while the peers waited."""
    got = triton_specializations(name, param, [0, 1, 2, 16, 17, 128, 1000, 4096])
    assert got == [["i32", None]] * 8


@pytest.mark.parametrize(
    "name", ["normal_dispatch_kernel", "normal_combine_kernel", "dispatch_layout_kernel"]
)
def test_top_k_compiles_one_variant_per_power_of_two(name):
    """The normal mode takes top-k as a runtime value (its tiles are ``BLOCK_K`` wide): top-k
    5 to 8 share a variant, and top-k 1 is not a variant of its own. A soak or a test suite
    that draws top-k at random then compiles three variants of each kernel instead of
    eight."""
    got = triton_specializations(name, "K", [1, 2, 3, 5, 8, 16])
    assert got == [["i32", None]] * 6


def test_limits_outside_the_int32_range_are_refused():
    from tritonep.kernels.sync import MAX_TIMEOUT_S, timeout_us

    for bad in (0, -1.0, float("nan"), MAX_TIMEOUT_S * 1.01):
        with pytest.raises(ValueError, match="timeout_s"):
            timeout_us(bad)
