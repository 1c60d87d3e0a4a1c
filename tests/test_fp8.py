"""The low-latency dispatch's FP8 quantization, bit for bit against the reference rule.

The kernel's quotients ``x / scale`` come from a reciprocal and one exact correction on GPUs
(:func:`tritonep.kernels.fp8.quantize_groups`), which must round exactly as IEEE division
does; under the interpreter (CPU) the division is done per value. Inputs span every binade
that BF16 holds, with the values that take special paths: signed zeros, subnormals, the
largest BF16, infinities, NaN, all-equal groups and padded groups (hidden sizes whose group
count is not a power of two), and partial last groups (hidden sizes that are not multiples of
128, such as gpt-oss's 2880: the group's scale comes from its own channels).
"""

import re

import pytest
import torch
import triton
import triton.language as tl

from tritonep.kernels.fp8 import e4m3_bits, from_bf16, quantize_groups
from tritonep.reference import fp8 as ref

ON_GPU = torch.cuda.is_available()


@triton.jit
def quantize_rows_kernel(
    x_ptr,
    q_ptr,
    code_ptr,
    scale_ptr,
    H: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    USE_UE8M0: tl.constexpr,
    EMULATE: tl.constexpr,
):
    G: tl.constexpr = (H + 127) // 128
    row = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, BLOCK_GROUPS)
    offs = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + row * H + offs, mask=offs < H, other=0.0)
    q, scale = quantize_groups(from_bf16(x, EMULATE), USE_UE8M0, EMULATE)
    tl.store(q_ptr + row * H + offs, q, mask=offs < H)
    tl.store(code_ptr + row * H + offs, e4m3_bits(q, EMULATE), mask=offs < H)
    tl.store(scale_ptr + row * G + groups, scale, mask=groups < G)


def hard_rows(rows: int, hidden: int, seed: int) -> torch.Tensor:
    """BF16 ``[rows, hidden]``: normal values at one magnitude per row, from 2**-133 to 2**127,
    then rows of special values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    x *= torch.exp2(torch.linspace(-133, 120, rows))[:, None]
    x = x.to(torch.bfloat16)
    inf, nan = float("inf"), float("nan")
    special = torch.tensor(
        [0.0, -0.0, 1e-40, -1e-39, 3.3895e38, -3.3895e38, inf, -inf, nan, 1.0], dtype=torch.bfloat16
    )
    picks = torch.randint(0, special.numel(), (4, hidden), generator=g)
    tail = special[picks]
    tail[0, :128] = 3.0  # an all-equal group
    tail[1, 128:256] = 0.0  # an all-zero group
    tail[2, : hidden // 2] = -0.0
    tail[3] = torch.where(tail[3].isnan() | tail[3].isinf(), 1.0, tail[3])  # finite extremes
    return torch.cat([x, tail])


def reference(x: torch.Tensor, use_ue8m0: bool):
    """(quotients after the clamp as float32, e4m3 codes, scales) of the reference rule."""
    scale = ref.fp8_scales(x, use_ue8m0=use_ue8m0)
    per_channel = scale.repeat_interleave(128, dim=1)[:, : x.shape[1]]
    q = (x.float() / per_channel).clamp(-ref.FP8_MAX, ref.FP8_MAX)
    return q, q.to(ref.FP8_DTYPE).view(torch.uint8), scale


@pytest.mark.parametrize("use_ue8m0", [False, True], ids=["f32-scales", "ue8m0"])
@pytest.mark.parametrize("hidden", [256, 7168, 200, 2880], ids=["h256", "h7168", "h200", "h2880"])
def test_quantization_is_bit_exact(hidden, use_ue8m0):
    device = "cuda" if ON_GPU else "cpu"
    rows = 2048 if ON_GPU else 12
    x = hard_rows(rows, hidden, seed=hidden + use_ue8m0)
    want_q, want_code, want_scale = reference(x, use_ue8m0)
    xd = x.to(device)
    q = torch.full(x.shape, 12345.0, device=device)  # poisoned: unwritten values show
    code = torch.full(x.shape, 0x55, dtype=torch.uint8, device=device)
    G = -(-hidden // 128)
    scale = torch.full((x.shape[0], G), -1.0, device=device)
    quantize_rows_kernel[(x.shape[0],)](
        xd,
        q,
        code,
        scale,
        H=hidden,
        BLOCK_GROUPS=triton.next_power_of_2(G),
        USE_UE8M0=use_ue8m0,
        EMULATE=not ON_GPU,
    )
    q, code, scale = q.cpu(), code.cpu(), scale.cpu()
    # NaN may carry any sign and payload; everything else must match in every bit.
    nan = want_q.isnan()
    assert torch.equal(q.isnan(), nan)
    bad = (q.view(torch.int32) != want_q.view(torch.int32)) & ~nan
    assert not bad.any(), (
        f"{int(bad.sum())} quotients differ, first at {bad.nonzero()[0].tolist()}: "
        f"x={x[bad][0].item()!r} got {q[bad][0].item()!r} want {want_q[bad][0].item()!r}"
    )
    code_nan = (want_code & 0x7F) == 0x7F
    assert torch.equal((code & 0x7F) == 0x7F, code_nan)
    assert torch.equal(code[~code_nan], want_code[~code_nan])
    scale_nan = want_scale.isnan()
    assert torch.equal(scale.isnan(), scale_nan)
    assert torch.equal(scale[~scale_nan], want_scale[~scale_nan])


@pytest.mark.parametrize(
    "dtype, use_ue8m0",
    [
        (torch.bfloat16, False),
        (torch.bfloat16, True),
        (torch.float16, False),
        (torch.float32, True),
    ],
    ids=["bf16", "bf16-ue8m0", "fp16", "fp32-ue8m0"],
)
@pytest.mark.parametrize("partial", [False, True], ids=["whole-groups", "partial-group"])
def test_quantize_fp8_launch_matches_the_reference(dtype, use_ue8m0, partial):
    """Whole groups, or a partial last group (gpt-oss's 2880 on GPUs, 200 on CPU)."""
    from tritonep.kernels.fp8 import quantize_fp8

    device = "cuda" if ON_GPU else "cpu"
    hidden = (2880 if ON_GPU else 200) if partial else (7168 if ON_GPU else 384)
    x = hard_rows(64 if ON_GPU else 6, hidden, seed=7).to(dtype)
    # Rows with a stride beyond the hidden size: every other row of a wider tensor.
    wide = torch.zeros(x.shape[0], 2 * hidden, dtype=dtype)
    wide[:, :hidden] = x
    for given in (x.to(device), wide.to(device)[:, :hidden]):
        q, scales = quantize_fp8(given, use_ue8m0=use_ue8m0)
        want_q, want_scales = ref.quantize_fp8(x, use_ue8m0=use_ue8m0)
        assert q.dtype == torch.float8_e4m3fn and list(q.shape) == list(x.shape)
        groups = -(-hidden // 128)
        assert scales.dtype == torch.float32 and list(scales.shape) == [x.shape[0], groups]
        got, want = q.cpu().view(torch.uint8), want_q.view(torch.uint8)
        nan = (want & 0x7F) == 0x7F
        assert torch.equal((got & 0x7F) == 0x7F, nan)
        assert torch.equal(got[~nan], want[~nan])
        assert torch.equal(scales.cpu().isnan(), want_scales.isnan())
        finite = ~want_scales.isnan()
        assert torch.equal(scales.cpu()[finite], want_scales[finite])
    empty_q, empty_scales = quantize_fp8(x[:0].to(device))
    assert empty_q.shape == (0, hidden) and empty_scales.shape == (0, -(-hidden // 128))


@pytest.mark.parametrize(
    "x, error, message",
    [
        ([[1.0]], TypeError, "x: expected a torch.Tensor"),
        (torch.zeros(2, 128, dtype=torch.int32), TypeError, "x: expected dtype"),
        (torch.zeros(2, 0, dtype=torch.bfloat16), ValueError, "with H >= 1"),
        (torch.zeros(2, 2, 128, dtype=torch.bfloat16), ValueError, "expected shape [N, H]"),
        (torch.zeros(256, 2, dtype=torch.bfloat16).t(), ValueError, "unit stride"),
    ],
    ids=["list", "int32", "h0", "3d", "column-major"],
)
def test_quantize_fp8_rejects_bad_input(x, error, message):
    from tritonep.kernels.fp8 import quantize_fp8

    with pytest.raises(error, match=re.escape(message)):
        quantize_fp8(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("partial", [False, True], ids=["whole-groups", "partial-group"])
def test_dequantize_fp8_launch_matches_the_reference(dtype, partial):
    """Whole groups, or a partial last group (gpt-oss's 2880 on GPUs, 200 on CPU)."""
    from tritonep.kernels.fp8 import dequantize_fp8

    device = "cuda" if ON_GPU else "cpu"
    hidden = (2880 if ON_GPU else 200) if partial else (7168 if ON_GPU else 384)
    groups = -(-hidden // 128)
    rows = 64 if ON_GPU else 6
    g = torch.Generator().manual_seed(11)
    # Every e4m3 code in every row, shuffled; scales of every magnitude, powers of two, 0, inf.
    codes = torch.stack([torch.randperm(256, generator=g) for _ in range(-(-rows * hidden // 256))])
    q = codes.flatten()[: rows * hidden].reshape(rows, hidden).to(torch.uint8)
    q = q.view(torch.float8_e4m3fn)
    scales = torch.exp2(torch.randn(rows, groups, generator=g) * 40)
    scales[0, 0], scales[1, 0], scales[2, 0] = 0.0, float("inf"), 2.0**-20
    scales[3, -1] = 2.0**-30  # the partial group's own scale (not its neighbour's)
    wide_q = torch.zeros(rows, 2 * hidden, dtype=torch.uint8).view(torch.float8_e4m3fn)
    wide_q[:, :hidden] = q
    wide_s = torch.zeros(rows, 2 * groups)
    wide_s[:, :groups] = scales
    want = ref.dequantize_fp8(q, scales).to(dtype)
    for given_q, given_s in ((q, scales), (wide_q[:, :hidden], wide_s[:, :groups])):
        got = dequantize_fp8(given_q.to(device), given_s.to(device), dtype=dtype).cpu()
        assert got.dtype == dtype and got.shape == want.shape
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        # The same bits wherever the value is not NaN (signed zeros included).
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        bad = (got.view(bits) != want.view(bits)) & ~nan
        assert not bad.any(), (
            f"{int(bad.sum())} values differ, first at {bad.nonzero()[0].tolist()}: "
            f"got {got[bad][0].item()!r} want {want[bad][0].item()!r}"
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("partial", [False, True], ids=["whole-groups", "partial-group"])
def test_dequantize_fp8_of_low_latency_layout(dtype, partial):
    """``[E_local, rows, H]`` payloads with scales column-major per expert (the low-latency
    dispatch's layout: strides ``(G * rows, 1, rows)``), the same as the reference."""
    from tritonep.kernels.fp8 import dequantize_fp8

    device = "cuda" if ON_GPU else "cpu"
    experts, rows = (4, 96) if ON_GPU else (3, 5)
    hidden = (2880 if ON_GPU else 200) if partial else (7168 if ON_GPU else 384)
    G = -(-hidden // 128)
    g = torch.Generator().manual_seed(12)
    codes = torch.randint(0, 256, (experts, rows, hidden), generator=g, dtype=torch.uint8)
    q = codes.view(torch.float8_e4m3fn)
    scales = torch.exp2(torch.randn(experts, G, rows, generator=g) * 30).transpose(1, 2)
    assert scales.stride() == (G * rows, 1, rows)
    want = ref.dequantize_fp8(q, scales).to(dtype)
    got = dequantize_fp8(q.to(device), scales.to(device), dtype=dtype).cpu()
    assert got.shape == want.shape and got.is_contiguous()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])


def test_dequantize_fp8_rejects_bad_input():
    from tritonep.kernels.fp8 import dequantize_fp8

    q = torch.zeros(2, 256, dtype=torch.float8_e4m3fn)
    s = torch.ones(2, 2)
    cases = [
        ((q.float(), s), TypeError, "q: expected dtype torch.float8_e4m3fn"),
        ((q, s.double()), TypeError, "scales: expected dtype torch.float32"),
        ((q, s[:, :1]), ValueError, "scales: expected shape [2, 2]"),
        ((q[:, :0], s), ValueError, "with H >= 1"),
        ((q[:, :200], s[:, :1]), ValueError, "scales: expected shape [2, 2]"),  # ceil(200 / 128)
        ((q, s, torch.float16), TypeError, "dtype: expected"),
        ((q[None], s), ValueError, "scales: expected shape [1, 2, 2]"),
        ((q[None, None], s[None, None]), ValueError, "q: expected shape [N, H] or [B, N, H]"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            dequantize_fp8(*args)
