"""Phase codes: one table, every code distinct and named."""

import triton.language as tl

from tritonep.kernels import phases


def test_every_phase_code_is_distinct_and_named():
    codes = {
        name: value.value
        for name, value in vars(phases).items()
        if name.isupper() and isinstance(value, tl.constexpr)
    }
    assert len(codes) >= 15
    assert len(set(codes.values())) == len(codes), codes
    assert set(phases.NAMES) == set(codes.values())
    assert all(phases.NAMES.values())
