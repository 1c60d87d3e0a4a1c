"""Property tests of the reference against brute-force loops written independently of it."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonep import reference as ref
from tritonep.testing import make_case

settings.register_profile("tritonep", deadline=None, max_examples=40)
settings.load_profile("tritonep")


@st.composite
def cases(draw, max_ranks=8, min_hidden_groups=1):
    num_ranks = draw(st.integers(1, max_ranks))
    experts_per_rank = draw(st.integers(1, 4))
    num_experts = num_ranks * experts_per_rank
    topk = draw(st.integers(1, min(16, num_experts)))
    num_tokens = draw(st.lists(st.integers(0, 9), min_size=num_ranks, max_size=num_ranks))
    routing = draw(st.sampled_from(["random", "skewed", "dropped", "empty"]))
    # Whole groups of 128 channels, or a partial last group of 80 (rows of 16-byte multiples).
    hidden = 128 * draw(st.integers(min_hidden_groups, 2)) - draw(st.sampled_from([0, 48]))
    seed = draw(st.integers(0, 2**31 - 1))
    return make_case(seed, num_tokens, hidden, num_experts, topk, routing)


def owner_of(expert, num_experts, num_ranks):
    return expert // (num_experts // num_ranks)


@given(cases())
def test_layout_matches_loops(case):
    R, E = case.num_ranks, case.num_experts
    for idx in case.topk_idx:
        layout = ref.dispatch_layout(idx, E, R)
        per_rank, per_expert = [0] * R, [0] * E
        for t, row in enumerate(idx.tolist()):
            ranks = {owner_of(e, E, R) for e in row if e >= 0}
            for r in range(R):
                assert bool(layout.is_token_in_rank[t, r]) == (r in ranks)
            for r in ranks:
                per_rank[r] += 1
            for e in row:
                if e >= 0:
                    per_expert[e] += 1
        assert layout.num_tokens_per_rank.tolist() == per_rank
        assert layout.num_tokens_per_expert.tolist() == per_expert
        assert layout.num_tokens_per_rank.dtype == torch.int32
        assert layout.num_tokens_per_expert.dtype == torch.int32


@given(cases(), st.sampled_from([1, 4, 128]), st.booleans())
def test_normal_dispatch_matches_loops(case, alignment, fp8):
    R, E = case.num_ranks, case.num_experts
    E_local = E // R
    xs = [ref.quantize_fp8(x) for x in case.x] if fp8 else case.x
    out = ref.normal_dispatch(xs, case.topk_idx, case.topk_weights, E, alignment)
    for d in range(R):
        expected_rows = []  # (src, token) in the required order
        for s in range(R):
            for t, row in enumerate(case.topk_idx[s].tolist()):
                if any(e >= 0 and owner_of(e, E, R) == d for e in row):
                    expected_rows.append((s, t))
        got = out[d]
        assert (
            list(zip(got.recv_src_rank.tolist(), got.recv_src_idx.tolist(), strict=True))
            == expected_rows
        )
        counts = [0] * E_local
        for i, (s, t) in enumerate(expected_rows):
            if fp8:
                assert torch.equal(
                    got.recv_x[0][i].view(torch.uint8), xs[s][0][t].view(torch.uint8)
                )
                assert torch.equal(got.recv_x[1][i], xs[s][1][t])
            else:
                assert torch.equal(got.recv_x[i], case.x[s][t])
            for k, e in enumerate(case.topk_idx[s][t].tolist()):
                local = e - d * E_local if e >= 0 and owner_of(e, E, R) == d else -1
                assert int(got.recv_topk_idx[i, k]) == local
                w = float(case.topk_weights[s][t, k]) if local >= 0 else 0.0
                assert float(got.recv_topk_weights[i, k]) == w
                if local >= 0:
                    counts[local] += 1
        assert got.num_recv_tokens_per_expert == [
            math.ceil(c / alignment) * alignment for c in counts
        ]


@given(cases())
def test_normal_combine_of_dispatch_is_x_times_fanout(case):
    """DeepEP's check: combine(dispatch(x)) == x * number of ranks the token went to."""
    R, E = case.num_ranks, case.num_experts
    out = ref.normal_dispatch(case.x, case.topk_idx, case.topk_weights, E)
    combined = ref.normal_combine(
        [o.recv_x for o in out],
        out,
        [x.shape[0] for x in case.x],
        recv_topk_weights=[o.recv_topk_weights for o in out],
    )
    for s in range(R):
        layout = ref.dispatch_layout(case.topk_idx[s], E, R)
        fanout = layout.is_token_in_rank.sum(dim=1, keepdim=True).float()
        x, w = combined[s]
        assert x.dtype == torch.bfloat16
        assert torch.equal(x, (case.x[s].float() * fanout).to(torch.bfloat16))
        # every weight comes back exactly once (and -1 slots as 0)
        valid = case.topk_idx[s] >= 0
        assert torch.equal(w, torch.where(valid, case.topk_weights[s], 0.0))


def test_normal_combine_adds_bias_and_sums_in_float32():
    case = make_case(3, [5, 0, 7], 128, 6, 3)
    out = ref.normal_dispatch(case.x, case.topk_idx, None, 6)
    bias = [torch.ones(x.shape[0], 128, dtype=torch.bfloat16) for x in case.x]
    combined = ref.normal_combine(
        [o.recv_x for o in out], out, [5, 0, 7], bias=[(b, b) for b in bias]
    )
    for s in range(3):
        fanout = ref.dispatch_layout(case.topk_idx[s], 6, 3).is_token_in_rank.sum(1, keepdim=True)
        expected = (case.x[s].float() * fanout + 2.0).to(torch.bfloat16)
        assert torch.equal(combined[s][0], expected)
        assert combined[s][1] is None


@given(cases(), st.booleans(), st.booleans())
def test_low_latency_dispatch_matches_loops(case, use_fp8, ue8m0):
    R, E = case.num_ranks, case.num_experts
    E_local = E // R
    max_tokens = max(max(x.shape[0] for x in case.x), 1)
    out = ref.low_latency_dispatch(case.x, case.topk_idx, max_tokens, E, use_fp8, ue8m0)
    for d in range(R):
        got = out[d]
        assert got.recv_x.shape == (E_local, R * max_tokens, case.x[0].shape[1])
        assert got.recv_src_info.dtype == torch.int32 and got.recv_layout_range.dtype == torch.int64
        for e in range(E_local):
            begin = 0
            for s in range(R):
                tokens = [
                    t for t, row in enumerate(case.topk_idx[s].tolist()) if d * E_local + e in row
                ]
                b, c = (int(v) for v in ref.unpack_range(got.recv_layout_range[e, s]))
                assert (b, c) == (begin, len(tokens))
                assert got.recv_src_info[e, b : b + c].tolist() == tokens
                for i, t in enumerate(tokens):
                    row = got.recv_x[e, b + i]
                    if use_fp8:
                        q, scale = ref.quantize_fp8(case.x[s][t : t + 1], use_ue8m0=ue8m0)
                        assert torch.equal(row.view(torch.uint8), q[0].view(torch.uint8))
                        assert torch.equal(got.recv_x_scales[e, b + i], scale[0])
                    else:
                        assert torch.equal(row, case.x[s][t])
                begin += c
            assert int(got.recv_count[e]) == begin


@given(cases())
def test_low_latency_combine_is_x_times_weight_sum(case):
    """DeepEP's check: with identity experts, combine == x * sum of valid weights."""
    R, E = case.num_ranks, case.num_experts
    max_tokens = max(max(x.shape[0] for x in case.x), 1)
    out = ref.low_latency_dispatch(case.x, case.topk_idx, max_tokens, E, use_fp8=False)
    combined = ref.low_latency_combine(
        [o.recv_x for o in out], case.topk_idx, case.topk_weights, out
    )
    for s in range(R):
        wsum = torch.where(case.topk_idx[s] >= 0, case.topk_weights[s], 0.0).sum(1, keepdim=True)
        expected = case.x[s].float() * wsum
        got = combined[s].float()
        assert combined[s].dtype == torch.bfloat16
        assert torch.all((got - expected).abs() <= expected.abs() * 2**-7 + 1e-6)


def test_low_latency_combine_uses_each_experts_own_row():
    """Distinct outputs per expert: every (token, k) must read its own expert's row."""
    case = make_case(11, [6, 3], 128, 8, 4)
    out = ref.low_latency_dispatch(case.x, case.topk_idx, 6, 8, use_fp8=False)
    # expert output = (global expert id + 1) * row
    outputs = [
        o.recv_x * (torch.arange(4).view(4, 1, 1) + 4 * d + 1).to(torch.bfloat16)
        for d, o in enumerate(out)
    ]
    combined = ref.low_latency_combine(outputs, case.topk_idx, case.topk_weights, out)
    for s in range(2):
        expected = torch.zeros(case.x[s].shape)
        for t in range(case.x[s].shape[0]):
            for k, e in enumerate(case.topk_idx[s][t].tolist()):
                row = (case.x[s][t] * (e + 1)).to(torch.bfloat16).float()
                expected[t] += float(case.topk_weights[s][t, k]) * row
        torch.testing.assert_close(combined[s].float(), expected, rtol=2**-7, atol=1e-6)


def test_low_latency_blocks_compare_in_any_order():
    case = make_case(5, [4, 4, 4], 128, 3, 2)
    expected = ref.low_latency_dispatch(case.x, case.topk_idx, 4, 3)[0]
    # Move source 2's block to the front of expert 0, as a GPU might.
    begins, counts = ref.unpack_range(expected.recv_layout_range[0])
    order = [2, 0, 1]
    shuffled = ref.LowLatencyDispatchResult(
        expected.recv_x.clone(),
        expected.recv_x_scales.clone(),
        expected.recv_src_info.clone(),
        expected.recv_count.clone(),
        expected.recv_layout_range.clone(),
    )
    pos = 0
    for s in order:
        b, c = int(begins[s]), int(counts[s])
        shuffled.recv_x[0, pos : pos + c] = expected.recv_x[0, b : b + c]
        shuffled.recv_x_scales[0, pos : pos + c] = expected.recv_x_scales[0, b : b + c]
        shuffled.recv_src_info[0, pos : pos + c] = expected.recv_src_info[0, b : b + c]
        shuffled.recv_layout_range[0, s] = ref.pack_range(pos, c)
        pos += c
    ref.assert_low_latency_dispatch_equal(shuffled, expected)
    # and a single flipped byte is caught
    shuffled.recv_x.view(torch.uint8)[0, 0, 5] ^= 1
    try:
        ref.assert_low_latency_dispatch_equal(shuffled, expected)
    except AssertionError as e:
        assert "payload" in str(e)
    else:
        raise AssertionError("a corrupted payload byte went unnoticed")


@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 3, 17]), st.booleans())
def test_fp8_round_trip_and_rules(seed, tokens, ue8m0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 384, generator=gen) * torch.logspace(-6, 6, 384).view(1, 384)
    x[0, :128] = 0.0  # an all-zero group
    x = x.to(torch.bfloat16)
    q, scale = ref.quantize_fp8(x, use_ue8m0=ue8m0)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (tokens, 3)
    amax = x.float().view(tokens, 3, 128).abs().amax(-1).clamp_min(ref.AMAX_FLOOR)
    if ue8m0:
        assert torch.all(scale >= amax / 448) and torch.all(scale < 2 * amax / 448)
        mantissa, _ = torch.frexp(scale)
        assert torch.all(mantissa == 0.5)
    else:
        assert torch.equal(scale, amax / 448)
    dq = ref.dequantize_fp8(q, scale)
    assert not torch.isnan(dq).any()
    assert torch.all(dq[0, :128] == 0)
    step = scale.repeat_interleave(128, dim=1) * 2.0**-9  # e4m3 subnormal step, scaled
    assert torch.all((dq - x.float()).abs() <= x.float().abs() * 2.0**-4 + step)


@given(st.integers(0, 2**31 - 1), st.sampled_from([8, 64, 72, 120]), st.booleans())
def test_fp8_partial_group_is_a_group_of_its_own_channels(seed, tail, ue8m0):
    """A hidden size of 2 groups and ``tail`` channels quantizes as if zero-padded to a whole
    group (DeepEP's ``per_token_cast_to_fp8``): the last scale from the tail's channels alone,
    ``ceil(H / 128)`` scales, UE8M0 packs of them; the padding changes nothing."""
    gen = torch.Generator().manual_seed(seed)
    hidden = 256 + tail
    x = torch.randn(5, hidden, generator=gen) * torch.exp2(torch.randn(5, 1, generator=gen) * 8)
    x[1, 256:] = 0.0  # an all-zero partial group
    x[2, 256:] *= 1e4  # a partial group far larger than its neighbour
    x = x.to(torch.bfloat16)
    q, scale = ref.quantize_fp8(x, use_ue8m0=ue8m0)
    padded = torch.nn.functional.pad(x, (0, 128 - tail))
    want_q, want_scale = ref.quantize_fp8(padded, use_ue8m0=ue8m0)
    assert q.shape == x.shape and scale.shape == (5, 3)
    ref.assert_bitwise_equal(q, want_q[:, :hidden], "partial-group payload")
    ref.assert_bitwise_equal(scale, want_scale, "partial-group scales")
    amax = x[:, 256:].float().abs().amax(-1).clamp_min(ref.AMAX_FLOOR)
    if not ue8m0:
        assert torch.equal(scale[:, 2], amax / 448)
    want = ref.dequantize_fp8(want_q, want_scale)[:, :hidden]
    ref.assert_bitwise_equal(ref.dequantize_fp8(q, scale), want, "partial-group dequantized")
    assert ref.pack_ue8m0(scale).shape == (5, 1)


def test_fp8_extremes_stay_finite():
    big = torch.finfo(torch.bfloat16).max
    x = torch.tensor([[big, -big] + [0.0] * 126, [1e-38, -1e-38] + [0.0] * 126]).to(torch.bfloat16)
    q, scale = ref.quantize_fp8(x)
    dq = ref.dequantize_fp8(q, scale)
    assert torch.isfinite(dq).all()
    torch.testing.assert_close(dq[0, :2], x[0, :2].float(), rtol=2**-4, atol=0)


def test_pack_range_round_trip():
    packed = ref.pack_range(torch.tensor([0, 5, 2**20]), torch.tensor([3, 0, 77]))
    begin, count = ref.unpack_range(packed)
    assert begin.tolist() == [0, 5, 2**20] and count.tolist() == [3, 0, 77]
    assert ref.pack_range(7, 9) == (7 << 32) | 9


def test_bitwise_comparison_matches_any_nan_and_nothing_else():
    neg_nan = (
        torch.tensor([0xFFC00000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    )  # x86's NaN
    pos_nan = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)  # a GPU's NaN
    ref.assert_bitwise_equal(neg_nan, pos_nan, "float32 NaNs")
    fp8_nans = torch.tensor([0x7F, 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)
    ref.assert_bitwise_equal(fp8_nans[:1], fp8_nans[1:], "e4m3 NaNs")
    for got, want in [(pos_nan, torch.ones(1)), (torch.zeros(1), -torch.zeros(1))]:
        with pytest.raises(AssertionError, match="1 elements differ"):
            ref.assert_bitwise_equal(got, want, "values")
    with pytest.raises(AssertionError, match="1 elements differ"):
        ref.assert_bitwise_equal(fp8_nans[:1], torch.zeros(1, dtype=torch.float8_e4m3fn), "e4m3")


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), span=st.floats(0.5, 40.0))
def test_logfmt_round_trip_errors_stay_in_half_a_step(seed, span):
    """Groups below 1 are encoded: every value rounds to the nearer of its two codes (in
    linear terms), at most 511 distinct magnitudes, signs and zeros kept, the largest
    magnitude exact."""
    gen = torch.Generator().manual_seed(seed)
    # Magnitudes spread over `span` octaves below 1 (clipped at 32), random signs.
    octaves = -0.01 - torch.rand(4, 256, generator=gen) * span
    signs = torch.where(torch.rand(4, 256, generator=gen) < 0.5, -1.0, 1.0)
    x = (signs * torch.exp2(octaves)).to(torch.bfloat16)
    x[0, 3] = 0
    encoded, log_amin, step = ref.logfmt_params(x)
    assert encoded.all()
    y = ref.logfmt_round_trip(x)
    xf = x.float()
    assert (y * xf >= 0).all() and (y[xf == 0] == 0).all()
    groups = xf.abs().unflatten(-1, (-1, 128))
    amax, amin = groups.amax(-1), groups.amin(-1)
    assert torch.equal(log_amin, torch.maximum(torch.log2(amin), torch.log2(amax) - 32))
    assert torch.allclose(step * 510, torch.log2(amax) - log_amin, rtol=1e-5, atol=1e-5)
    # Between codes c and c + 1 (a factor 2**step apart), values below their midpoint go
    # down, the others up.
    up = torch.exp2(step).repeat_interleave(128, -1)
    kept = xf.abs() >= torch.exp2(log_amin).repeat_interleave(128, -1)  # not clipped
    ratio = (y.abs() / xf.abs())[kept]
    assert (ratio <= 2 / (1 + 1 / up[kept]) * (1 + 1e-5)).all()
    assert (ratio >= 2 / (1 + up[kept]) * (1 - 1e-5)).all()
    assert (y.abs() <= ref.logfmt_error_bound(x) + xf.abs()).all()
    for g, values in enumerate(y.abs().unflatten(-1, (-1, 128)).flatten(0, 1)):
        assert values.unique().numel() <= 512  # 511 codes and zero
        row, group = divmod(g, 2)
        assert torch.isclose(values.max(), amax[row, group], rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), tail=st.sampled_from([8, 64, 72, 120]))
def test_logfmt_partial_group_is_a_group_of_its_own_channels(seed, tail):
    """A partial last group (``tail`` channels) takes LogFMT's parameters from its own
    channels: the same as a whole group holding them and copies of them (copies change
    neither its smallest nor its largest magnitude), not zeros (which would)."""
    gen = torch.Generator().manual_seed(seed)
    octaves = -0.01 - torch.rand(4, 128 + tail, generator=gen) * 12
    x = (torch.exp2(octaves) * torch.randn(4, 128 + tail, generator=gen).sign()).to(torch.bfloat16)
    x[1, 128:] = 2.0  # a partial group sent unchanged
    encoded, log_amin, step = ref.logfmt_params(x)
    assert encoded.shape == (4, 2) and encoded[:, 1].tolist() == [True, False, True, True]
    copies = x[:, 128:].repeat(1, -(-128 // tail))[:, :128]
    whole = torch.cat([x, copies[:, tail:]], dim=1)
    w_encoded, w_log_amin, w_step = ref.logfmt_params(whole)
    assert torch.equal(encoded, w_encoded)
    assert torch.equal(log_amin, w_log_amin) and torch.equal(step, w_step)
    y = ref.logfmt_round_trip(x)
    ref.assert_bitwise_equal(y, ref.logfmt_round_trip(whole)[:, : 128 + tail], "round trip")
    bound = ref.logfmt_error_bound(x)
    assert torch.equal(bound, ref.logfmt_error_bound(whole)[:, : 128 + tail])
    # Zero padding would have clipped the codes 32 octaves below the largest magnitude.
    zeros = torch.nn.functional.pad(x, (0, 128 - tail))
    assert not torch.equal(ref.logfmt_params(zeros)[1][:, 1], log_amin[:, 1])


def test_logfmt_leaves_groups_it_cannot_encode_unchanged():
    x = (torch.rand(6, 256) * 0.5 + 0.01).to(torch.bfloat16)
    x[0, :128] = 0  # all zero
    x[1, :128] = 0.25  # all equal: nothing to spread codes over
    x[2, 7] = 1.0  # a magnitude of 1 or more
    x[3, 9] = float("nan")
    x[4, 130] = float("-inf")
    encoded, _, step = ref.logfmt_params(x)
    assert encoded.tolist() == [
        [False, True],
        [False, True],
        [False, True],
        [False, True],
        [True, False],
        [True, True],
    ]
    assert (step[~encoded] == 0).all() and (step[encoded] > 0).all()
    y = ref.logfmt_round_trip(x)
    plain = ~encoded.repeat_interleave(128, -1)
    ref.assert_bitwise_equal(y[plain], x.float()[plain], "groups sent unchanged")
    assert not torch.equal(y[~plain], x.float()[~plain])
