"""Triton kernels, one operation per module, each with a thin host wrapper or mode above it.

* :mod:`.sync` -- acquire/release flags, aligned heap pointers and bounded waits;
* :mod:`.put_signal` -- store a block into a peer and raise a flag there;
* :mod:`.fp8` -- FP8 e4m3 quantization per 128 channels and exact BF16/e4m3 rounding;
* :mod:`.ll_dispatch` -- low-latency dispatch (quantize, send, count, receive and pack);
* :mod:`.ll_combine` -- low-latency combine (send rows back, weighted reduce);
* :mod:`.layout` -- where each token goes (per rank, per expert), in one launch;
* :mod:`.normal_notify`, :mod:`.normal_dispatch`, :mod:`.normal_combine` -- normal mode: the
  count exchange, then channel-ring dispatch and combine;
* :mod:`.trace` -- timer readings for kernel traces and wait statistics (compiled out when off).
"""
