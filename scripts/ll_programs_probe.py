"""Probe: does low-latency mode at 256 experts complete with P programs per launch?"""

import sys
import time

import torch

from tritonep.launch import spawn


def body(ctx, programs, coop):
    from tritonep.modes import low_latency as ll

    mode = ll.LowLatencyMode(None, 128, 7168, 256, max_topk=8, device=ctx.device, timeout_s=3,
                             num_programs=programs)
    if not coop:
        mode._launch = lambda kernel, ga, both: kernel[(mode.num_programs,)](*ga[0], **ga[1])
    x = torch.randn(128, 7168, device=ctx.device).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(256, device=ctx.device)[:8] for _ in range(128)])
    w = torch.rand(128, 8, device=ctx.device)
    out = []
    for _ in range(3):
        t = time.perf_counter()
        recv, cnt, h, _ = mode.dispatch(x, idx)
        y = torch.zeros(64, 512, 7168, device=ctx.device, dtype=torch.bfloat16)
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
    for programs, coop in [(int(a.split(":")[0]), a.endswith("c")) for a in sys.argv[1:]]:
        try:
            print(programs, coop, spawn(body, 4, programs, coop, backend="nccl", timeout=60)[0])
        except Exception as e:
            print(programs, coop, "FAILED", str(e)[-600:])
