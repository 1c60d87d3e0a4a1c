"""LogFMT-10: the lossy 10-bit format of a ``use_logfmt`` low-latency combine (DeepEP's rule).

Each group of 128 channels of a BF16 row travels either unchanged or, when every magnitude
in it is below 1 and they are not all equal, as a sign bit and a 9-bit code per channel:
code 0 is zero, code ``c >= 1`` is ``2 ** (log_amin + (c - 1) * step)`` with
``log_amax = log2(max |x|)``, ``log_amin = max(log2(min |x|), log_amax - 32)`` and
``step = (log_amax - log_amin) / 510``, so codes 1 and 511 are the group's smallest and
largest magnitudes. Values round to the nearest code in linear terms. Relative error is at
most ``(2 ** step - 1) / (2 ** step + 1)`` (2.2% when a group spans 32 octaves, 0.1% when
it spans 1.5).
Groups holding NaN or Inf travel unchanged. 10 bits instead of 16 cut a combine's payload
to 160 of 256 bytes per group (plus 8 bytes of group metadata).

Where ``H`` is not a multiple of 128 the last group holds the channels left over (64 of
gpt-oss's 2880) and its parameters come from them alone.
"""

from __future__ import annotations

import torch

GROUP = 128
CODE_MAX = 511
MIN_CLIP = 32.0  # octaves below the group's largest magnitude that codes still reach


def _groups(x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``x [..., H]`` as float32 ``[..., ceil(H / 128), 128]``, a partial last group padded
    with ``fill``."""
    pad = -x.shape[-1] % GROUP
    return torch.nn.functional.pad(x.float(), (0, pad), value=fill).unflatten(-1, (-1, GROUP))


def logfmt_params(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per 128-channel group of ``x [..., H]`` (the last one partial where ``H`` is not a
    multiple of 128): ``(encoded, log_amin, step)``.

    ``encoded`` (bool) says whether the group travels as LogFMT; ``log_amin`` and ``step``
    (float32) are its code parameters (``step`` is 0 for groups sent unchanged).
    """
    groups = _groups(x).abs()  # zeros pad: they change neither the largest nor finiteness
    special = ~torch.isfinite(groups).all(-1)
    amax = groups.amax(-1)
    log_amax = torch.log2(amax)
    amin = _groups(x, float("inf")).abs().amin(-1)  # the smallest of the real channels
    log_amin = torch.maximum(torch.log2(amin), log_amax - MIN_CLIP)
    encoded = (log_amax < 0) & (log_amin < log_amax) & ~special
    step = torch.where(encoded, (log_amax - log_amin) / (CODE_MAX - 1), 0.0)
    return encoded, torch.where(encoded, log_amin, 0.0), step


def logfmt_round_trip(x: torch.Tensor) -> torch.Tensor:
    """What the receiver of ``x [..., H]`` (BF16) reads after LogFMT: float32 ``[..., H]``."""
    encoded, log_amin, step = logfmt_params(x)
    groups = _groups(x)
    safe = torch.where(encoded, step, 1.0).unsqueeze(-1)
    low = log_amin.unsqueeze(-1)
    # Round to the nearer code in linear terms: code c + 1 from the midpoint of the values
    # of c and c + 1 up (DeepEP's rounding offset).
    rounding = 2.0 - torch.log2((1.0 + torch.exp2(safe)) * 0.5) / safe
    code = torch.floor(torch.clamp(torch.log2(groups.abs()) / safe + rounding - low / safe, min=0))
    code = torch.clamp(code, max=CODE_MAX)
    magnitude = torch.where(code > 0, torch.exp2((code - 1) * safe + low), 0.0)
    decoded = torch.where(groups < 0, -magnitude, magnitude)
    return torch.where(encoded.unsqueeze(-1), decoded, groups).flatten(-2)[..., : x.shape[-1]]


def logfmt_error_bound(x: torch.Tensor) -> torch.Tensor:
    """Largest error a channel of ``x [..., H]`` may carry through LogFMT, float32: one code
    step of its magnitude (twice the rounding error, so that a code off by one at a rounding
    boundary, as approximate ``log2`` on GPUs may give, still passes), plus the smallest
    code's magnitude (what values clipped below it may lose)."""
    encoded, log_amin, step = logfmt_params(x)
    groups = _groups(x).abs()
    floor = torch.where(encoded, torch.exp2(log_amin), 0.0)
    bound = groups * (torch.exp2(step) - 1).unsqueeze(-1) + floor.unsqueeze(-1)
    return bound.flatten(-2)[..., : x.shape[-1]]
