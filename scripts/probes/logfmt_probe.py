"""What LogFMT costs a combine: encoding (the sender) and decoding (the reduce), one GPU.

    PYTHONPATH=src python scripts/probes/logfmt_probe.py [--rows 1024] [--topk 8] [--programs 128]

Encoding: each program takes a contiguous run of BF16 rows and stores them into slots laid
out as the combine receive buffer, either plainly (``copy``, the BF16 combine's send) or as
LogFMT (``logfmt``, the kernel's own ``_send_logfmt``) for several chunk sizes (groups
encoded at a time) and warp counts. Decoding: ``rows / topk`` tokens each sum their
``topk`` slots, BF16 (``copy``) or LogFMT (the kernel's own ``_load_logfmt``), a chunk of
channels at a time. Times are CUDA-graph replays (``do_bench_cudagraph``), microseconds.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from tritonep.kernels.ll_combine import _load_logfmt, _send_logfmt


@triton.jit
def encode_probe(src, dst, n_rows, H: tl.constexpr, GROUPS: tl.constexpr, LOGFMT: tl.constexpr):
    pid = tl.program_id(0)
    per = tl.cdiv(n_rows, tl.num_programs(0))
    G: tl.constexpr = H // 128
    SLOT: tl.constexpr = 2 * H + G * 8
    flat = tl.arange(0, 8192)
    for row in range(pid * per, tl.minimum(pid * per + per, n_rows)):
        rows = tl.full((1,), row, tl.int64)
        if LOGFMT:
            _send_logfmt(src + rows * H, dst.to(tl.int64) + rows * SLOT, rows >= 0, H, G, GROUPS,
                         1, True)  # fmt: skip
        else:
            y = tl.load(src + row * H + flat, mask=flat < H)
            tl.store((dst + row * SLOT).to(tl.pointer_type(tl.bfloat16)) + flat, y, mask=flat < H)


@triton.jit
def decode_probe(slots, out, n_tokens, H: tl.constexpr, K: tl.constexpr, BW: tl.constexpr,
                 LOGFMT: tl.constexpr):  # fmt: skip
    G: tl.constexpr = H // 128
    SLOT: tl.constexpr = 2 * H + G * 8
    for token in range(tl.program_id(0), n_tokens, tl.num_programs(0)):
        for c0 in range(0, H, BW):
            if LOGFMT:
                groups = c0 // 128 + tl.arange(0, BW // 128)
                cols = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
                acc = tl.zeros((BW // 128, 128), tl.float32)
            else:
                cols = c0 + tl.arange(0, BW)
                acc = tl.zeros((BW,), tl.float32)
            for k in tl.static_range(K):
                row = slots.to(tl.int64) + (token * K + k).to(tl.int64) * SLOT
                if LOGFMT:
                    acc += _load_logfmt(row, groups, groups < G, H, True)
                else:
                    y = tl.load(row.to(tl.pointer_type(tl.bfloat16)) + cols, mask=cols < H,
                                cache_modifier=".cg")  # fmt: skip
                    acc += y.to(tl.float32)
            tl.store(out + token * H + cols, acc.to(tl.bfloat16), mask=cols < H)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--programs", type=int, default=128)
    args = parser.parse_args()
    H, K = args.hidden, args.topk
    x = (torch.randn(args.rows, H, device="cuda") * 0.1).to(torch.bfloat16)
    slots = torch.empty(args.rows, 2 * H + H // 128 * 8, dtype=torch.uint8, device="cuda")
    out = torch.empty(args.rows // K, H, dtype=torch.bfloat16, device="cuda")

    def time(name, launch):
        launch()
        us = triton.testing.do_bench_cudagraph(launch) * 1e3
        print(f"{name:<40} {us:8.1f} us", flush=True)

    for logfmt, groups, warps in [(False, 8, 8)] + [
        (True, g, w) for g in (8, 16, 32, 64) for w in (8, 16)
    ]:
        time(f"encode {'logfmt' if logfmt else 'copy'} groups {groups} warps {warps}",
             lambda g=groups, w=warps, lf=logfmt: encode_probe[(args.programs,)](
                 x, slots, args.rows, H, g, lf, num_warps=w))  # fmt: skip
    for logfmt, bw, warps in [(False, 4096, 8)] + [
        (True, b, w) for b in (1024, 2048, 4096) for w in (8, 16)
    ]:
        if logfmt:  # slots hold LogFMT rows from here on
            encode_probe[(args.programs,)](x, slots, args.rows, H, 16, True, num_warps=8)
        time(f"decode {'logfmt' if logfmt else 'copy'} channels {bw} warps {warps}",
             lambda b=bw, w=warps, lf=logfmt: decode_probe[(args.programs,)](
                 slots, out, args.rows // K, H, K, b, lf, num_warps=w))  # fmt: skip


if __name__ == "__main__":
    main()
