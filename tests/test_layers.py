"""The layer APIs, the MoE layer example and the autograd functions, on CPU ranks and GPUs.

* ``EPAll2AllLayer``: every output row, weight and expert range against a brute-force walk over
  all ranks' routing (dropped choices given as ``-1`` and as ``num_experts``, int32 and int64
  ids), and combine against the float64 sum of each copy's own expert output;
* the MoE layer (both modes, BF16 and FP8) against the dense single-process layer;
* a training step: the gradients of the input, the router and the experts against autograd
  through the dense layer; with activation checkpointing, a cached handle and
  ``torch.compile`` the gradients must not change;
* the autograd operators: ``torch.compile(fullgraph=True)`` and selective activation
  checkpointing (their outputs saved: no dispatch is recomputed) give the eager values and
  gradients, and every handle leaves the registry once nothing refers to it.
"""

import gc

import pytest
import torch
import torch.distributed as dist

from tests.conftest import gpu_ranks
from tritonep import Buffer
from tritonep.integrations import EPAll2AllLayer, autograd
from tritonep.integrations.moe import MoELayer, dense_moe, init_params, local_experts, route
from tritonep.integrations.serving import PrepareFinalize, TwoPhaseDispatcher
from tritonep.reference import dequantize_fp8
from tritonep.testing import make_case, tag_rows


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the largest magnitude of ``want``."""
    if want.numel() == 0:
        return 0.0
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


# ------------------------------------------------------------------------- EPAll2AllLayer
def _expected_copies(case, rank, experts_per_rank):
    """Per local expert, the (row, weight) of every copy it must receive, in source order."""
    rows, weights, counts = [], [], []
    for e in range(rank * experts_per_rank, (rank + 1) * experts_per_rank):
        n = 0
        for src, ids in enumerate(case.topk_idx):
            for t in range(ids.shape[0]):
                for k in range(ids.shape[1]):
                    if int(ids[t, k]) == e:
                        rows.append(case.x[src][t])
                        weights.append(case.topk_weights[src][t, k])
                        n += 1
        counts.append(n)
    hidden = case.x[0].shape[1]
    x = torch.stack(rows) if rows else torch.empty(0, hidden, dtype=torch.bfloat16)
    return x, torch.tensor(weights, dtype=torch.float32), counts


def _expert_scale(global_expert):
    # Copies of one token on one rank must each bring their own expert's output.
    return (global_expert % 7 + 1) / 4


def _ep_layer_body(ctx, tokens, hidden, experts_per_rank, topk, routing, id_dtype):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    E = experts_per_rank * R
    layer = EPAll2AllLayer(None, max(tokens), hidden, topk, me, E, R, R)
    for call in range(2):
        case = tag_rows(make_case(50 * call + 3, tokens[:R], hidden, E, topk, routing))
        ids = case.topk_idx[me].clone()
        # Half of the dropped choices in Triton-distributed's convention (id == number of experts).
        marker = torch.arange(ids.numel()).view(ids.shape) % 2 == 0
        ids = torch.where((ids == -1) & marker, E, ids)
        out, weights, desc = layer.dispatch(
            case.x[me].to(dev), ids.to(id_dtype).to(dev), case.topk_weights[me].to(dev)
        )
        want_x, want_w, counts = _expected_copies(case, me, experts_per_rank)
        assert torch.equal(out.cpu(), want_x), f"rank {me} call {call}: rows"
        assert torch.equal(weights.cpu(), want_w), f"rank {me} call {call}: weights"
        assert desc.tokens_per_expert_list == counts
        assert desc.expert_offsets.cpu().tolist() == [
            sum(counts[:i]) for i in range(len(counts) + 1)
        ]

        # Each copy hands back its own expert's output, weighted.
        local = torch.repeat_interleave(torch.arange(experts_per_rank), torch.tensor(counts))
        scale = torch.tensor([_expert_scale(me * experts_per_rank + e) for e in local.tolist()])
        y = (out.cpu().float() * (weights.cpu() * scale).unsqueeze(1)).to(torch.bfloat16)
        combined = layer.combine(y.to(dev), desc)
        x, idx, w = case.x[me].double(), case.topk_idx[me], case.topk_weights[me].double()
        expected = torch.zeros(x.shape, dtype=torch.float64)
        for k in range(topk):
            valid = idx[:, k] >= 0
            s = torch.tensor([_expert_scale(int(e)) for e in idx[:, k].clamp_min(0)])
            expected += torch.where(valid, w[:, k] * s, 0).unsqueeze(1) * x
        # Two BF16 roundings: of each rank's sum, and of the total.
        assert rel_err(combined, expected) < 1e-2, f"rank {me} call {call}: combine"
    layer.finalize()
    return True


# Three ranks: a rank of no tokens beside ranks of some, and a group that is no power of two;
# the kernels below the layer are tested at 2 ranks in their own files.
@pytest.mark.parametrize("num_ranks", [3])
@pytest.mark.parametrize(
    "tokens, hidden, experts, topk, routing, id_dtype",
    [
        ([9, 0, 6], 128, 3, 4, "random", torch.int64),
        ([5, 8, 7], 256, 2, 3, "dropped", torch.int32),
        ([4, 6, 0], 128, 2, 2, "empty", torch.int64),
    ],
    ids=["random", "dropped-int32", "empty"],
)
def test_ep_all2all_layer(run_ranks, num_ranks, tokens, hidden, experts, topk, routing, id_dtype):
    results = run_ranks(num_ranks, _ep_layer_body, tokens, hidden, experts, topk, routing, id_dtype)
    assert results == [True] * num_ranks


@pytest.mark.gpu(n=1)
def test_ep_all2all_layer_on_gpus(run_ranks):
    R = gpu_ranks()
    results = run_ranks(
        R, _ep_layer_body, [300, 0, 257, 64], 1024, 4, 8, "dropped", torch.int32, timeout=240
    )
    assert results == [True] * R


def test_ep_all2all_layer_rejects_bad_arguments(run_ranks):
    assert run_ranks(2, _ep_layer_errors_body) == [True, True]


def _ep_layer_errors_body(ctx):
    R, me = ctx.world_size, ctx.rank
    with pytest.raises(ValueError, match="local_world_size"):
        EPAll2AllLayer(None, 8, 128, 2, me, 4, 1, R)
    with pytest.raises(ValueError, match="rank, world_size"):
        EPAll2AllLayer(None, 8, 128, 2, (me + 1) % R, 4, R, R)
    layer = EPAll2AllLayer(None, 8, 128, 2, me, 4, R, R)
    dev = ctx.device
    x = torch.zeros(8, 128, dtype=torch.bfloat16, device=dev)
    ids = torch.zeros(8, 2, dtype=torch.int64, device=dev)
    w = torch.ones(8, 2, device=dev)
    with pytest.raises(ValueError, match="max_tokens"):
        layer.dispatch(torch.zeros(9, 128, dtype=torch.bfloat16, device=dev), ids, w)
    # Dropped by the kernels and raised by the call itself, after its launches (an exact-size
    # dispatch reads the host anyway): every rank stays in step.
    bad = r"topk_idx: token 0, column 0 of rank \d's get_dispatch_layout names expert 5, "
    with pytest.raises(ValueError, match=bad + r"outside \[-1, 4\)"):
        layer.dispatch(x, torch.full((8, 2), 5, device=dev), w)
    with pytest.raises(TypeError, match="routing_weights"):
        layer.dispatch(x, ids, w.double())
    with pytest.raises(TypeError, match="layout_desc"):
        layer.combine(x, None)
    dist.barrier()
    layer.finalize()
    return True


# ----------------------------------------------------------------------------- MoE layer
def _inputs(tokens, hidden, seed):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in tokens]
    grads = [torch.randn(n, hidden, generator=gen) for n in tokens]
    return xs, grads


def _dense_grads(xs, grads, router, experts, topk):
    """Output and gradients of the dense layer over every rank's tokens at once."""
    x = torch.cat(xs).float().detach().requires_grad_()
    r = router.clone().requires_grad_()
    e = experts.clone().requires_grad_()
    out = dense_moe(x, r, e, topk)
    (out * torch.cat(grads)).sum().backward()
    return out.detach(), x.grad, r.grad, e.grad


def _moe_body(ctx, tokens, hidden, experts_per_rank, topk, use_fp8, variant):
    """One training step of the MoE layer on every rank, against the dense layer."""
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    tokens = tokens[:R]
    E = experts_per_rank * R
    router, experts = init_params(hidden, E, seed=1)
    xs, grads = _inputs(tokens, hidden, seed=2)
    start = sum(tokens[:me])
    mine = slice(start, start + tokens[me])
    buffer = Buffer(device=dev, gpus_per_node=2 if variant == "internode" else None)
    worst = sum(tokens) + 3 if variant == "worst" else 0  # padding rows must stay inert
    layer = MoELayer(
        buffer, router.to(dev), experts.to(dev), topk, use_fp8=use_fp8, num_worst_tokens=worst
    )
    x = xs[me].to(dev).requires_grad_()
    if variant == "checkpoint":
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    elif variant == "compile":
        out = torch.compile(layer, backend="aot_eager")(x)
    else:
        out = layer(x)
    (out.float() * grads[me].to(dev)).sum().backward()
    router_grad = layer.router.grad.clone()
    dist.all_reduce(router_grad)  # each rank's router gradient covers its own tokens

    want_out, want_x, want_router, want_experts = _dense_grads(xs, grads, router, experts, topk)
    tol = 6e-2 if use_fp8 else 2e-2  # BF16 rows and outputs; FP8 rows forward
    first = me * experts_per_rank
    errors = {
        "out": rel_err(out, want_out[mine]),
        "x grad": rel_err(x.grad, want_x[mine]),
        "router grad": rel_err(router_grad, want_router),
        "expert grad": rel_err(layer.experts.grad, want_experts[first : first + experts_per_rank]),
    }
    bad = {k: v for k, v in errors.items() if not v < tol}
    assert not bad, f"rank {me}: relative errors {bad} above {tol}"

    if variant == "cached":
        # The handle of a dispatch moves new rows along the same routing.
        ids = torch.softmax(x.detach().float() @ layer.router.detach(), -1).topk(topk).indices
        recv, _, _, _, handle = autograd.dispatch(buffer, x.detach(), ids, None, E)
        x2 = (x.detach().float() * 2).to(torch.bfloat16)
        again, idx2, w2, _, _ = autograd.dispatch(buffer, x2, handle=handle)
        assert idx2 is None and w2 is None
        assert torch.equal(again, (recv.float() * 2).to(torch.bfloat16)), f"rank {me}: cached"
        # Its backward is a combine on the same handle: with the rows themselves as their
        # gradient (loss = |rows|^2 / 2), token t gets x2[t] once from every rank it went to.
        x2.requires_grad_()
        rows, _, _, _, _ = autograd.dispatch(buffer, x2, handle=handle)
        (rows.float().square().sum() / 2).backward()
        went_to = [len(set((ids[t] // experts_per_rank).tolist())) for t in range(len(ids))]
        went_to = torch.tensor(went_to, dtype=torch.float32, device=dev).unsqueeze(1)
        want = (x2.detach().float() * went_to).to(torch.bfloat16)
        assert torch.equal(x2.grad, want), f"rank {me}: cached dispatch backward"
    buffer.destroy()
    return errors


# Three ranks cover what two did: rank 1 has no tokens, ranks 0 and 2 some. The plain BF16
# step is the first half of "cached" (the same step and checks, then a cached dispatch).
@pytest.mark.parametrize("num_ranks", [3])
@pytest.mark.parametrize(
    "use_fp8, variant",
    [(True, "plain"), (False, "checkpoint"), (False, "cached"), (True, "worst")],
    ids=["fp8", "checkpoint", "cached", "fp8-worst"],
)
def test_moe_training_step_matches_dense(run_ranks, num_ranks, use_fp8, variant):
    results = run_ranks(num_ranks, _moe_body, [12, 0, 9], 128, 2, 3, use_fp8, variant)
    assert len(results) == num_ranks


def test_moe_training_step_across_emulated_nodes(run_ranks):
    results = run_ranks(4, _moe_body, [12, 0, 9, 5], 128, 2, 3, False, "internode")
    assert len(results) == 4


def test_moe_training_step_under_torch_compile(run_ranks):
    results = run_ranks(2, _moe_body, [10, 7], 128, 2, 2, False, "compile", timeout=600)
    assert len(results) == 2


def _step(buffer, x, ids, weights, scale, num_experts, worst):
    """A small MoE step made of the three operators and elementwise expert math only."""
    recv_x, recv_idx, recv_w, counts, handle = autograd.dispatch(
        buffer, x, ids, weights, num_experts, num_worst_tokens=worst
    )
    y = recv_x.float() * scale * (1 + recv_w.sum(-1, keepdim=True)) + (recv_idx >= 0).sum(-1, True)
    return autograd.combine(buffer, y.to(torch.bfloat16), handle), counts


def _operators_body(ctx, variant, worst, backend="aot_eager"):
    """``torch.compile(fullgraph=True)`` and selective activation checkpointing through the
    autograd operators give the eager values and gradients; handles leave the registry."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    from tritonep.integrations.autograd import _HANDLES

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    E, N, H, K = 4 * R, [13, 6, 9, 0][me], 128, 3
    gen = torch.Generator().manual_seed(10 + me)
    x0 = torch.randn(N, H, generator=gen).to(torch.bfloat16)
    ids0 = torch.randn(N, E, generator=gen).topk(K).indices
    ids0[:1, 1] = -1
    w0 = torch.rand(N, K, generator=gen)
    scale = torch.tensor(1.5, requires_grad=True)
    buffer = Buffer(device=dev)
    gc.collect()  # handles of earlier tests in this rank process that only wait for collection
    registered = len(_HANDLES)
    calls = []  # per Buffer.dispatch call: True for a full dispatch, False for a cached one
    real_dispatch = buffer.dispatch

    def counted(*args, **kwargs):
        calls.append(kwargs.get("handle") is None)
        return real_dispatch(*args, **kwargs)

    buffer.dispatch = counted

    def run(fn):
        x, w = x0.to(dev).requires_grad_(), w0.to(dev).requires_grad_()
        scale.grad = None
        calls.clear()
        out, counts = fn(buffer, x, ids0.to(dev), w, scale, E, worst)
        (out.float() * torch.arange(H, device=dev)).sum().backward()
        return out.detach(), counts, x.grad, w.grad, scale.grad.clone(), list(calls)

    want = run(_step)
    assert want[-1] == [True, False]  # the dispatch, then the combine's gradient (cached)
    if variant == "compile":
        got = run(torch.compile(_step, backend=backend, fullgraph=True, dynamic=False))
    else:

        def policy(_, op, *args, **kwargs):
            ours = op in (torch.ops.tritonep.dispatch.default, torch.ops.tritonep.combine.default)
            return CheckpointPolicy.MUST_SAVE if ours else CheckpointPolicy.PREFER_RECOMPUTE

        def checkpointed(*args):
            context = lambda: create_selective_checkpoint_contexts(policy)
            return checkpoint(_step, *args, use_reentrant=False, context_fn=context)

        got = run(checkpointed)
        # The recomputation moved nothing: no dispatch beyond the eager step's two.
        assert got[-1] == [True, False], f"rank {me}: dispatches {got[-1]}"
    # Inductor may order the float32 math of the expert step differently: close, not equal.
    exact = variant != "compile" or backend == "aot_eager"
    names = ["out", "counts", "x grad", "weights grad", "scale grad"]
    for name, a, b in zip(names, got[:5], want[:5], strict=True):
        if exact or name == "counts":
            assert torch.equal(a.cpu(), b.cpu()), f"rank {me}: {variant} {name} differs"
        else:
            torch.testing.assert_close(a.cpu(), b.cpu(), rtol=2e-2, atol=2e-2, msg=name)
    del got, want
    buffer.dispatch = real_dispatch
    gc.collect()
    assert len(_HANDLES) == registered, f"rank {me}: handles left in the registry"
    buffer.destroy()
    return True


@pytest.mark.parametrize("worst", [0, 40], ids=["exact", "worst"])
@pytest.mark.parametrize("variant", ["compile", "selective-checkpoint"])
def test_autograd_operators_compile_and_checkpoint(run_ranks, variant, worst):
    assert run_ranks(2, _operators_body, variant, worst, timeout=600) == [True, True]


@pytest.mark.gpu(n=1)
@pytest.mark.parametrize("worst", [0, 40], ids=["exact", "worst"])
@pytest.mark.parametrize("variant", ["compile", "selective-checkpoint"])
def test_autograd_operators_on_gpus(run_ranks, variant, worst):
    """The same on GPUs, compiled by Inductor."""
    R = gpu_ranks()
    assert run_ranks(R, _operators_body, variant, worst, "inductor", timeout=600) == [True] * R


def test_autograd_handles_are_checked():
    buffer = Buffer.__new__(Buffer)
    buffer.key = -1
    with pytest.raises(TypeError, match="handle: expected a DispatchHandle"):
        autograd.combine(buffer, torch.zeros(1, 8, dtype=torch.bfloat16), object())
    with pytest.raises(TypeError, match="num_experts: expected an int"):
        autograd.dispatch(buffer, torch.zeros(1, 8), torch.zeros(1, 1, dtype=torch.long))
    other = autograd.DispatchHandle(torch.tensor([1]), -2, 1, 1)
    with pytest.raises(ValueError, match="handle: made by the buffer with key -2"):
        autograd.combine(buffer, torch.zeros(1, 8, dtype=torch.bfloat16), other)
    released = autograd.DispatchHandle(torch.tensor([-5]), -1, 1, 1)
    with pytest.raises(ValueError, match="handle: no dispatch handle -5"):
        torch.ops.tritonep.combine(torch.zeros(1, 8), released.id, None, -1, 1)


@pytest.mark.gpu(n=1)
@pytest.mark.parametrize(
    "use_fp8, variant",
    [(False, "plain"), (True, "plain"), (False, "checkpoint"), (False, "compile")],
    ids=["bf16", "fp8", "checkpoint", "compile"],
)
def test_moe_training_step_on_gpus(run_ranks, use_fp8, variant):
    R = gpu_ranks()
    results = run_ranks(R, _moe_body, [500, 0, 333, 64], 512, 4, 4, use_fp8, variant)
    assert len(results) == R


@pytest.mark.gpu(n=1)
@pytest.mark.parametrize("style", ["vllm", "sglang"])
def test_serving_adapters_on_gpus(run_ranks, style):
    R = gpu_ranks()
    for mode, use_fp8 in [("low_latency", True), ("normal", False)]:
        assert len(run_ranks(R, _adapter_body, style, mode, use_fp8)) == R


def _moe_forward_body(ctx, tokens, hidden, experts_per_rank, topk, mode, use_fp8):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    tokens = tokens[:R]
    E = experts_per_rank * R
    router, experts = init_params(hidden, E, seed=3)
    xs, _ = _inputs(tokens, hidden, seed=4)
    buffer = Buffer(device=dev)
    layer = MoELayer(buffer, router.to(dev), experts.to(dev), topk, mode, use_fp8, max(tokens))
    with torch.no_grad():
        out = layer(xs[me].to(dev))
    buffer.check()
    buffer.destroy()
    want = dense_moe(xs[me], router, experts, topk)
    err = rel_err(out, want)
    assert err < (6e-2 if use_fp8 else 2e-2), f"rank {me}: relative error {err}"
    return err


@pytest.mark.parametrize(
    "mode, use_fp8",
    [("normal", False), ("low_latency", False), ("low_latency", True)],
    ids=["normal", "low-latency-bf16", "low-latency-fp8"],
)
def test_moe_layer_forward_matches_dense(run_ranks, mode, use_fp8):
    results = run_ranks(3, _moe_forward_body, [11, 0, 7], 128, 2, 3, mode, use_fp8)
    assert len(results) == 3


# ------------------------------------------------------------------------------ adapters
def _adapter_body(ctx, style, mode, use_fp8, hidden=128):
    """The MoE layer through a serving adapter, against the dense layer."""
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    tokens, experts_per_rank, topk = [9, 0, 6, 5][:R], 2, 3
    E = experts_per_rank * R
    router, experts = init_params(hidden, E, seed=5)
    xs, _ = _inputs(tokens, hidden, seed=6)
    x = xs[me].to(dev)
    ids, weights = route(x, router.to(dev), topk)
    mine = experts[me * experts_per_rank : (me + 1) * experts_per_rank].to(dev)
    buffer = Buffer(device=dev)
    if style == "vllm":
        adapter = PrepareFinalize(buffer, E, mode, max(tokens), use_fp8)
        prepared = adapter.prepare(x, weights, ids)
    else:
        adapter = TwoPhaseDispatcher(buffer, E, mode, max(tokens), use_fp8)
        prepared = adapter.dispatch_b(adapter.dispatch_a(x, ids, weights))
    rows = prepared.tokens.float()
    if prepared.scales is not None:
        rows = dequantize_fp8(prepared.tokens, prepared.scales)
    if mode == "low_latency":
        y = torch.bmm(rows, mine.float())
    else:
        y = local_experts(rows, prepared.topk_ids, prepared.topk_weights, mine)
    y = y.to(torch.bfloat16)
    if style == "vllm":
        out = torch.full_like(x, float("nan"))
        adapter.finalize(out, y, weights, ids, prepared)
    else:
        out = adapter.combine_b(adapter.combine_a(y, prepared))
    buffer.check()
    buffer.destroy()
    err = rel_err(out, dense_moe(xs[me], router, experts, topk))
    assert err < (6e-2 if use_fp8 else 2e-2), f"rank {me}: relative error {err}"
    return err


@pytest.mark.parametrize("style", ["vllm", "sglang"])
@pytest.mark.parametrize(
    "mode, use_fp8",
    [("low_latency", True), ("low_latency", False), ("normal", True), ("normal", False)],
    ids=["ll-fp8", "ll-bf16", "normal-fp8", "normal-bf16"],
)
def test_serving_adapters_match_dense(run_ranks, style, mode, use_fp8):
    assert len(run_ranks(3, _adapter_body, style, mode, use_fp8)) == 3


@pytest.mark.parametrize(
    "style, mode", [("vllm", "normal"), ("sglang", "low_latency")], ids=["vllm-normal", "sglang-ll"]
)
def test_serving_adapters_at_a_partial_group(run_ranks, style, mode):
    # FP8 at hidden 208: rows of 13 x 16 bytes, the last group of 128 channels holds 80.
    assert len(run_ranks(2, _adapter_body, style, mode, True, 208)) == 2
