"""Argument checks shared by every API: each names the argument and what was expected.

Type and dtype problems raise ``TypeError``; shapes, devices, layouts and values raise
``ValueError``. They run on the host before any kernel is launched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeGuard

import torch
import torch.distributed as dist


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | str | None = None,
    contiguous: bool = True,
) -> torch.Tensor:
    """Check a tensor argument; ``None`` in ``shape`` matches any size."""
    # Runs several times per eager call: plain comparisons first, messages only on failure.
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype is not dtype:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if shape is not None:
        got = t.shape
        ok = len(got) == len(shape)
        if ok:
            for g, size in zip(got, shape, strict=True):
                if size is not None and g != size:
                    ok = False
                    break
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if device is not None and t.device != device:
        if not isinstance(device, torch.device):
            device = torch.device(device)
        if t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous() first)")
    return t


def check_dispatch_x(name: str, x: object) -> torch.Tensor:
    """Tokens to dispatch: BF16 ``[N, H]``, or a tuple (e4m3 ``[N, H]``, scales ``[N, S]``).

    The scales are 4-byte words that travel unchanged, as in DeepEP: float32 (one per 128
    channels, ``ceil(H / 128)`` of them, or per token, ...) or int32 (e.g. UE8M0 exponents
    packed four to a word), any strides, ``1 <= S <= ceil(H / 32)``. FP8 rows must be a
    positive multiple of 16 bytes (``H`` a multiple of 16; the mode checks BF16 rows against
    its hidden size). Returns the payload tensor (the first element of a tuple).
    """
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"{name}: expected a tuple (x_e4m3, scales), got {len(x)} elements")
        payload = check_tensor(f"{name}[0]", x[0], dtype=torch.float8_e4m3fn, shape=(None, None))
        num_tokens, hidden = payload.shape
        if hidden == 0 or hidden % 16:
            raise ValueError(
                f"{name}[0]: FP8 rows must be a positive multiple of 16 bytes "
                f"(H a multiple of 16), got hidden {hidden}"
            )
        check_tensor(
            f"{name}[1]",
            x[1],
            dtype=(torch.float32, torch.int32),
            shape=(num_tokens, None),
            contiguous=False,
        )
        if not 1 <= x[1].shape[1] <= -(-hidden // 32):
            raise ValueError(
                f"{name}[1]: expected 1 to {-(-hidden // 32)} scale words per token "
                f"(hidden {hidden}), got {x[1].shape[1]}"
            )
        if x[1].device != payload.device:
            raise ValueError(f"{name}[1]: expected a tensor on {payload.device}, got {x[1].device}")
        return payload
    if isinstance(x, torch.Tensor) and x.dtype != torch.bfloat16:
        raise TypeError(
            f"{name}: expected dtype torch.bfloat16 (FP8 goes as a tuple (x, scales)), "
            f"got {x.dtype}"
        )
    return check_tensor(name, x, dtype=torch.bfloat16, shape=(None, None))


def check_num_experts(num_experts: int, num_ranks: int) -> int:
    """The experts must split evenly over the ranks; returns experts per rank."""
    if not isinstance(num_experts, int) or isinstance(num_experts, bool):
        raise TypeError(f"num_experts: expected an int, got {type(num_experts).__name__}")
    if num_experts <= 0 or num_experts % num_ranks != 0:
        raise ValueError(
            f"num_experts: expected a positive multiple of the number of ranks ({num_ranks}), "
            f"got {num_experts}"
        )
    return num_experts // num_ranks


def check_hidden(name: str, hidden: int, multiple: int) -> None:
    if hidden <= 0 or hidden % multiple != 0:
        raise ValueError(
            f"{name}: hidden size must be a positive multiple of {multiple}, got {hidden}"
        )


def check_topk_idx(
    name: str,
    topk_idx: object,
    num_tokens: int | None,
    num_experts: int,
    device: torch.device | str | None = None,
    check_range: bool = True,
) -> torch.Tensor:
    """``[num_tokens, K]`` int64 ids in ``[-1, num_experts)`` (``num_tokens=None``: any).

    The range check reads the ids on the host, which waits for the GPU; it is skipped while a
    CUDA graph is being captured (where no host read is allowed) or when ``check_range`` is
    False; kernels then ignore ids outside the range rather than write out of bounds.
    """
    check_tensor(name, topk_idx, dtype=torch.int64, shape=(num_tokens, None), device=device)
    assert isinstance(topk_idx, torch.Tensor)
    if topk_idx.shape[1] < 1:
        raise ValueError(
            f"{name}: expected at least one top-k column, got shape {list(topk_idx.shape)}"
        )
    if (
        check_range
        and topk_idx.numel()
        and not (topk_idx.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        lo, hi = (int(v) for v in torch.stack(torch.aminmax(topk_idx)).tolist())  # one sync
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            raise ValueError(
                f"{name}: expert ids must lie in [-1, {num_experts}) (-1 = no expert), found {bad}"
            )
    return topk_idx


def check_topk_weights(name: str, topk_weights: object, topk_idx: torch.Tensor) -> torch.Tensor:
    """float32 weights with the shape and device of ``topk_idx``."""
    return check_tensor(
        name, topk_weights, dtype=torch.float32, shape=tuple(topk_idx.shape), device=topk_idx.device
    )


def default_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group``, or the default process group when it is ``None``."""
    if group is not None:
        return group
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError(
            "group: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first or pass a process group"
        )
    return world


def check_ranks_agree(group: dist.ProcessGroup, what: str, **config: object) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` unless all pass equal values.

    Runs before anything collective is sized from the values: ranks that disagree on, say,
    the hidden size would otherwise compute different buffer layouts and write into each
    other's memory at the wrong offsets, or wait for messages that never come.
    """
    gathered: list[dict] = [{}] * dist.get_world_size(group)
    # ``what`` travels too: ranks that reached different objects (one rank's mode built for
    # several nodes, its peers' for one) must fail alike, with the key sets that differ.
    dist.all_gather_object(gathered, {"object": what, **config}, group=group)
    keys = dict.fromkeys(key for g in gathered for key in g)
    values = {key: [g.get(key, "<absent>") for g in gathered] for key in keys}
    differing = {key: v for key, v in values.items() if any(x != v[0] for x in v)}
    if differing:
        detail = "; ".join(f"{key} = {v} on ranks 0..{len(v) - 1}" for key, v in differing.items())
        # Rank 0's name for the object, so that every rank raises the very same message.
        raise ValueError(
            f"{values['object'][0]}: the ranks disagree on the configuration: {detail}"
        )


def plain_tensor(t: object, dtype: torch.dtype, device_index: int) -> TypeGuard[torch.Tensor]:
    """Whether ``t`` is a contiguous tensor of ``dtype`` on the device of index
    ``device_index`` (-1: the CPU): a call's checks as plain comparisons, before
    :func:`check_tensor` names whatever is wrong."""
    return (
        type(t) is torch.Tensor
        and t.dtype is dtype
        and t.get_device() == device_index
        and t.is_contiguous()
    )
