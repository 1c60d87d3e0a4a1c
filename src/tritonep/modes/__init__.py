"""Modes: host-side orchestration of the kernels over the symmetric heap.

* :mod:`.normal` -- training and prefill within a node: notify, channel rings, exact or
  worst-case output sizes, cached mode;
* :mod:`.internode` -- the normal mode across nodes: a network leg, then an NVLink leg;
* :mod:`.low_latency` -- decode: per-expert slabs, online FP8, double buffering, CUDA graphs;
* :mod:`.outputs` -- the calls' output tensors (poisoned when testing);
* :mod:`.trace` -- kernel traces as Chrome trace JSON.
"""
