"""Probe: does low-latency mode at 256 experts complete with P programs per launch?"""

import sys
import time

import torch

from tritonep.launch import spawn


def body(ctx, programs, coop, topk=8, hidden=7168):
    from tritonep.modes import low_latency as ll

    mode = ll.LowLatencyMode(None, 128, hidden, 256, max_topk=topk, device=ctx.device,
                             timeout_s=3, num_programs=programs)
    if not coop:
        mode._launch = lambda kernel, ga, both: kernel[(mode.num_programs,)](*ga[0], **ga[1])
    n = [128, 0, 77, 128][ctx.rank]
    x = torch.randn(n, hidden, device=ctx.device).to(torch.bfloat16)
    idx = torch.stack(
        [torch.randperm(256, device=ctx.device)[:topk] for _ in range(n)]
        or [torch.zeros(0, topk, dtype=torch.long, device=ctx.device)]
    ).view(n, topk)
    if n:
        idx[0, 1] = idx[0, 0]
    w = torch.rand(n, topk, device=ctx.device)
    out = []
    for _ in range(3):
        t = time.perf_counter()
        recv, cnt, h, _ = mode.dispatch(x, idx)
        y = torch.zeros(64, 512, hidden, device=ctx.device, dtype=torch.bfloat16)
        mode.combine(y, idx, w, h)
        torch.cuda.synchronize()
        try:
            mode.check()
            out.append(f"ok {1e3 * (time.perf_counter() - t):.1f}ms")
        except Exception as e:
            out.append(str(e)[:90])
            break
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        programs, topk, hidden = (int(v) for v in arg.split(":"))
        try:
            r = spawn(body, 4, programs, True, topk, hidden, backend="nccl", timeout=40)
            print(arg, r)
        except Exception as e:
            print(arg, "FAILED", str(e)[-800:])
