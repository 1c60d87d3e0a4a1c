"""Benchmarks: tritonep beside the ``torch`` backend (NCCL ``all_to_all_single``), same run.

``python -m tritonep.bench low-latency --ranks 4`` times low-latency dispatch and combine per
call (CUDA events around each op in a back-to-back loop, median per rank, mean over ranks)
and as CUDA-graph replays, at 128 tokens per rank, hidden 7168, top-8, 256 experts by
default, and over a sweep of token counts.

``python -m tritonep.bench normal --ranks 4`` times normal-mode dispatch (cached and full, BF16
and FP8) and combine at 4096 tokens per rank, hidden 7168, top-8, 256 experts by default, with
DeepEP's bandwidth accounting and remote bandwidth, eager (per call) and as CUDA-graph replays
(``graph_*``: device time; an eager time above it is the host's); ``--tokens``, ``--sms``,
``--chunk`` and ``--ring`` sweep token counts and configurations.
"""
