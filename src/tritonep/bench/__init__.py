"""Benchmarks: tritonep beside the ``torch`` backend (NCCL ``all_to_all_single``), same run.

``python -m tritonep.bench low-latency --ranks 4`` times low-latency dispatch and combine per
call (CUDA events around each op in a back-to-back loop, median per rank, mean over ranks)
and as CUDA-graph replays, at 128 tokens per rank, hidden 7168, top-8, 256 experts by
default, and over a sweep of token counts.
"""
