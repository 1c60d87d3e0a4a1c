"""Phase codes: the number a kernel writes into its status record to say which wait gave up
(or which ids it was reading), and the name the host puts in the error it raises.

Codes are unique across modes, so a record names its phase without knowing which kernel
wrote it (:mod:`tritonep.kernels.status`); :data:`NAMES` is the one table the modes pass to
:func:`~tritonep.kernels.status.check_status`.
"""

from __future__ import annotations

import triton.language as tl

#: The signal wait of the put-with-signal example kernel.
SIGNAL = tl.constexpr(1)

# Low-latency mode.
LL_DISPATCH_RECV = tl.constexpr(2)  # a receiving item waits for its sources' counts
LL_COMBINE_RECV = tl.constexpr(3)  # a reducing program waits for every sender's rows
LL_DISPATCH_IDS = tl.constexpr(4)  # a bad id read by a dispatch
LL_COMBINE_IDS = tl.constexpr(5)  # a bad id read by a combine

# Normal mode (and its internode legs).
NOTIFY = tl.constexpr(10)  # the count exchange
DISPATCH_SEND = tl.constexpr(11)  # a sender waits for ring space
DISPATCH_RECV = tl.constexpr(12)  # a receiver waits for rows
COMBINE_SEND = tl.constexpr(13)
COMBINE_RECV = tl.constexpr(14)
DISPATCH_RELAY = tl.constexpr(15)  # a forwarder waits for rows from the network leg
COMBINE_RELAY = tl.constexpr(16)  # a forwarder waits for sums from the NVLink leg
LAYOUT_IDS = tl.constexpr(17)  # a bad id read by get_dispatch_layout
DISPATCH_IDS = tl.constexpr(18)  # a bad id read by a dispatch
# A dispatch that runs the count exchange: a receiver waits for its launch's layout.
DISPATCH_COUNTS = tl.constexpr(19)

# Elastic mode (DeepEP V2's interface).
ELASTIC_DISPATCH = tl.constexpr(20)
ELASTIC_COMBINE = tl.constexpr(21)
ELASTIC_BARRIER = tl.constexpr(22)

# The normal mode's copy-engine combine.
COPY_COMBINE_DONE = tl.constexpr(23)  # a rank waits for a peer to have read its rows
COPY_COMBINE_RECV = tl.constexpr(24)  # a summing program waits for a peer's copied rows

#: Each code's name in error messages.
NAMES: dict[int, str] = {
    SIGNAL.value: "signal",
    LL_DISPATCH_RECV.value: "low-latency dispatch receive",
    LL_COMBINE_RECV.value: "low-latency combine receive",
    LL_DISPATCH_IDS.value: "low-latency dispatch",
    LL_COMBINE_IDS.value: "low-latency combine",
    NOTIFY.value: "notify",
    DISPATCH_SEND.value: "dispatch send",
    DISPATCH_RECV.value: "dispatch receive",
    COMBINE_SEND.value: "combine send",
    COMBINE_RECV.value: "combine receive",
    DISPATCH_RELAY.value: "dispatch relay (rows from the network leg)",
    COMBINE_RELAY.value: "combine relay (sums from the NVLink leg)",
    LAYOUT_IDS.value: "get_dispatch_layout",
    DISPATCH_IDS.value: "dispatch",
    DISPATCH_COUNTS.value: "dispatch (fused: waiting for its own count exchange)",
    ELASTIC_DISPATCH.value: "elastic dispatch",
    ELASTIC_COMBINE.value: "elastic combine",
    ELASTIC_BARRIER.value: "elastic barrier",
    COPY_COMBINE_DONE.value: "copy combine (waiting for the peer to read its rows)",
    COPY_COMBINE_RECV.value: "copy combine receive",
}
