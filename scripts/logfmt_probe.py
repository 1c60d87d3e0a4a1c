"""What encoding costs a LogFMT combine's sender: BF16 rows of 7168 channels on one GPU.

    PYTHONPATH=src python scripts/logfmt_probe.py [--rows 1024] [--programs 128]

Each program takes a contiguous run of rows and stores them into slots laid out as the
combine receive buffer, either plainly (``copy``, the BF16 combine's send) or as LogFMT
(``logfmt``, the kernel's own ``_send_logfmt``) for several chunk sizes (groups encoded at a
time) and warp counts. Times are CUDA-graph replays (``do_bench_cudagraph``), microseconds.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from tritonep.kernels.ll_combine import _send_logfmt


@triton.jit
def probe(src, dst, n_rows, H: tl.constexpr, GROUPS: tl.constexpr, LOGFMT: tl.constexpr):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--programs", type=int, default=128)
    args = parser.parse_args()
    H = args.hidden
    x = (torch.randn(args.rows, H, device="cuda") * 0.1).to(torch.bfloat16)
    slots = torch.empty(args.rows, 2 * H + H // 128 * 8, dtype=torch.uint8, device="cuda")
    variants = [("copy", 8, 8)] + [("logfmt", g, w) for g in (8, 16, 32) for w in (4, 8)]
    for name, groups, warps in variants:

        def run(groups=groups, logfmt=name == "logfmt", warps=warps):
            probe[(args.programs,)](x, slots, args.rows, H, groups, logfmt, num_warps=warps)

        run()
        us = triton.testing.do_bench_cudagraph(run) * 1e3
        print(f"{name:>6}  groups {groups:>2}  warps {warps}  {us:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
