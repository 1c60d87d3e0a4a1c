"""FP8 quantization of a batch of tokens and the way back: one-launch kernels against torch ops.

    PYTHONPATH=src python scripts/probes/quantize_probe.py [--tokens 128,4096,16384] [--hidden 7168]

Both give the same bits (checked here on every run); the reference takes several passes over
the tokens (group maxima, division, clamp, conversion), the kernel one. Times are CUDA-graph
replays (``do_bench_cudagraph``), microseconds, with the bytes moved (BF16 read, e4m3 and
scales written) over the kernel's time. De-quantization (e4m3 and scales read, BF16 written)
is timed against the reference's ``dequantize_fp8(q, s).to(torch.bfloat16)``, on the normal
mode's rows and on the low-latency dispatch's layout (``dq-ll``: experts x rows, column-major
scales).
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from tritonep.kernels.fp8 import dequantize_fp8, quantize_fp8
from tritonep.reference import fp8 as ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="128,4096,16384")
    parser.add_argument("--hidden", type=int, default=7168)
    args = parser.parse_args()
    print(f"{'tokens':>7} {'ue8m0':>6} {'reference us':>13} {'kernel us':>10} {'kernel GB/s':>12}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, args.hidden, device="cuda").to(torch.bfloat16)
        for ue8m0 in (False, True):
            q, s = quantize_fp8(x, use_ue8m0=ue8m0)
            want_q, want_s = ref.quantize_fp8(x, use_ue8m0=ue8m0)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), "payload differs"
            assert torch.equal(s, want_s), "scales differ"
            t_ref = triton.testing.do_bench_cudagraph(
                lambda x=x, u=ue8m0: ref.quantize_fp8(x, use_ue8m0=u), rep=200
            )
            t_kernel = triton.testing.do_bench_cudagraph(
                lambda x=x, u=ue8m0: quantize_fp8(x, use_ue8m0=u), rep=200
            )
            moved = x.numel() * 2 + q.numel() + s.numel() * 4
            print(f"{tokens:>7} {ue8m0!s:>6} {t_ref * 1e3:>13.1f} {t_kernel * 1e3:>10.1f} "
                  f"{moved / (t_kernel * 1e-3) / 1e9:>12.0f}")  # fmt: skip
        want = ref.dequantize_fp8(q, s).to(torch.bfloat16)
        assert torch.equal(dequantize_fp8(q, s).view(torch.int16), want.view(torch.int16))
        t_ref = triton.testing.do_bench_cudagraph(
            lambda q=q, s=s: ref.dequantize_fp8(q, s).to(torch.bfloat16), rep=200
        )
        t_kernel = triton.testing.do_bench_cudagraph(lambda q=q, s=s: dequantize_fp8(q, s), rep=200)
        print(f"{tokens:>7} {'dequant':>6} {t_ref * 1e3:>13.1f} {t_kernel * 1e3:>10.1f} "
              f"{moved / (t_kernel * 1e-3) / 1e9:>12.0f}")  # fmt: skip
    # The low-latency dispatch's layout: [E_local, R * max_tokens, H], scales column-major per
    # expert (64 local experts, 4 ranks x 128 tokens).
    experts, rows = 64, 512
    codes = torch.randint(0, 256, (experts, rows, args.hidden), device="cuda", dtype=torch.uint8)
    q = codes.view(torch.float8_e4m3fn)
    s = torch.rand(experts, args.hidden // 128, rows, device="cuda").transpose(1, 2)
    want = ref.dequantize_fp8(q, s).to(torch.bfloat16)
    got = dequantize_fp8(q, s)
    assert torch.equal(got.isnan(), want.isnan()), "NaN positions differ"
    assert torch.equal(got.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])
    t_ref = triton.testing.do_bench_cudagraph(
        lambda: ref.dequantize_fp8(q, s).to(torch.bfloat16), rep=200
    )
    t_kernel = triton.testing.do_bench_cudagraph(lambda: dequantize_fp8(q, s), rep=200)
    moved = q.numel() * 3 + s.numel() * 4
    print(f"{f'{experts}x{rows}':>7} {'dq-ll':>6} {t_ref * 1e3:>13.1f} {t_kernel * 1e3:>10.1f} "
          f"{moved / (t_kernel * 1e-3) / 1e9:>12.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
