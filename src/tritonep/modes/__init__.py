"""Modes: host-side orchestration of the kernels over the symmetric heap.

* :mod:`.low_latency` -- decode: per-expert slabs, online FP8, double buffering, CUDA graphs.
"""
