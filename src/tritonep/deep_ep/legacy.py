"""DeepEP's V1 ``Buffer`` (``deep_ep/buffers/legacy.py``): :class:`Buffer`, :class:`Config` and
the normal-mode handle that is also DeepEP's six-item tuple (:class:`LegacyHandle`).

Every difference from DeepEP is listed in ``docs/deepep-compat.md``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..buffer import Buffer as _Buffer
from ..buffer import ranks_per_node
from ..modes.normal import Config as _Config
from ..modes.normal import NormalHandle, NormalMode
from .utils import EventOverlap

__all__ = ["Buffer", "Config", "LegacyHandle"]


class Config(_Config):
    """DeepEP's ``Config``, with its argument names, order and defaults.

    Args:
        num_sms: programs of a normal-mode launch, half senders and half receivers (even).
        num_max_nvl_chunked_send_tokens: tokens a sender moves per step (rounded up to a power
            of two, at most 32; :attr:`nvl_send_chunk`).
        num_max_nvl_chunked_recv_tokens: slots per ring; more than the buffer's ring (128 on
            GPUs) get the buffer's ring (:attr:`nvl_recv_buffer_tokens`).
        num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens: the same for the
            network leg of a group that spans nodes.

    The values are honoured as given. Those in DeepEP's tuned tables (6-token chunks) suit its
    kernels; here a step has a fixed cost, and the configs of
    :meth:`Buffer.get_dispatch_config` (16 tokens a step) are faster.
    """

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ):
        super().__init__(
            num_sms,
            num_max_nvl_chunked_send_tokens,
            num_max_nvl_chunked_recv_tokens,
            num_max_rdma_chunked_send_tokens,
            num_max_rdma_chunked_recv_tokens,
        )

    num_max_nvl_chunked_send_tokens = property(lambda self: self.nvl_send_chunk)
    num_max_nvl_chunked_recv_tokens = property(lambda self: self.nvl_recv_buffer_tokens)
    num_max_rdma_chunked_send_tokens = property(lambda self: self.rdma_send_chunk)
    num_max_rdma_chunked_recv_tokens = property(lambda self: self.rdma_recv_buffer_tokens)


#: DeepEP's names of its intranode handle's six items, in order.
HANDLE_ITEMS = (
    "rank_prefix_matrix",
    "channel_prefix_matrix",
    "recv_channel_prefix_matrix",
    "recv_src_idx",
    "is_token_in_rank",
    "send_head",
)


class LegacyHandle(NormalHandle):
    """A normal-mode handle that is also DeepEP's intranode handle, the tuple
    ``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
    is_token_in_rank, send_head)``: ``handle[i]``, ``len(handle)`` and unpacking work.

    The items that DeepEP's kernels keep and these do not are derived from what the handle
    holds, each when first read (a few small tensor operations on the device, nothing when
    nobody reads them). ``R`` ranks, ``C`` channels (half the call's SMs), ``N`` tokens of
    this rank, ``M`` received rows; all int32 but ``is_token_in_rank``:

    * ``rank_prefix_matrix`` ``[R, R]``: ``[i][r]`` is the number of rows rank ``r`` receives
      from ranks ``0..i``. Column ``r = this rank`` is exact; the other columns are ``-1``
      (here ranks only learn the counts sent to them, DeepEP exchanges all of them);
    * ``channel_prefix_matrix`` ``[R, C]``: tokens this rank sends to rank ``r`` through
      channels ``0..c`` (channel ``c`` takes the ``c``-th of ``C`` equal token ranges);
    * ``recv_channel_prefix_matrix`` ``[R, C]``: the first received row of source ``r``'s
      channel ``c``, counted from source ``r``'s first row;
    * ``recv_src_idx`` ``[M]``: each received row's token index on its source rank;
    * ``is_token_in_rank`` ``[N, R]`` bool;
    * ``send_head`` ``[N, R]``: DeepEP's ring slot of each (token, destination); here the
      token's index among the rows this rank sends to that destination, ``-1`` where it is
      not sent.
    """

    #: The rank that made the dispatch (set by :meth:`of`, or by :meth:`of_rank`'s class; not
    #: a dataclass field).
    rank: int

    @staticmethod
    @functools.cache
    def of_rank(rank: int) -> type[LegacyHandle]:
        """The subclass whose handles belong to rank ``rank``: what a buffer's normal mode
        makes its dispatches' handles of (``NormalMode.handle_type``), so that no handle is
        copied into a :class:`LegacyHandle` per call."""
        return type("LegacyHandle", (LegacyHandle,), {"rank": rank, "__module__": __name__})

    @classmethod
    def of(cls, handle: NormalHandle, rank: int) -> LegacyHandle:
        """``handle`` (of a dispatch on rank ``rank``) as a :class:`LegacyHandle`."""
        out = cls.__new__(cls)
        # The fields as they are (a dataclass keeps them in its __dict__), without the launch
        # templates a handle may hold (modes.normal: kept per handle object).
        out.__dict__.update(handle.__dict__)
        out.__dict__.pop("_calls", None)
        out.rank = rank
        return out

    def __len__(self) -> int:
        return len(HANDLE_ITEMS)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(getattr(self, name) for name in HANDLE_ITEMS[index])
        return getattr(self, HANDLE_ITEMS[index])

    def __iter__(self):
        return (getattr(self, name) for name in HANDLE_ITEMS)

    @functools.cached_property
    def rank_prefix_matrix(self) -> torch.Tensor:
        num_ranks = self.is_token_in_rank.shape[1]
        matrix = torch.full(
            (num_ranks, num_ranks), -1, dtype=torch.int32, device=self.recv_count.device
        )
        matrix[:, self.rank] = self.recv_count.sum(1).cumsum(0).to(torch.int32)
        return matrix

    @functools.cached_property
    def channel_prefix_matrix(self) -> torch.Tensor:
        num_tokens, num_ranks = self.is_token_in_rank.shape
        channels = self.recv_count.shape[1]
        chunk = max(1, -(-num_tokens // channels))
        of_token = torch.arange(num_tokens, device=self.is_token_in_rank.device) // chunk
        counts = torch.zeros(
            channels, num_ranks, dtype=torch.int32, device=self.is_token_in_rank.device
        )
        counts.index_add_(0, of_token, self.is_token_in_rank.to(torch.int32))
        return counts.cumsum(0).to(torch.int32).T.contiguous()

    @functools.cached_property
    def recv_channel_prefix_matrix(self) -> torch.Tensor:
        return (self.recv_start - self.recv_start[:, :1]).contiguous()

    @functools.cached_property
    def send_head(self) -> torch.Tensor:
        sent = self.is_token_in_rank.to(torch.int32)
        return torch.where(self.is_token_in_rank, sent.cumsum(0) - 1, -1).to(torch.int32)


class Buffer(_Buffer):
    """DeepEP's ``Buffer``: one communication buffer per expert-parallel group.

    Args:
        group: the process group; every rank constructs the buffer together.
        num_nvl_bytes: accepted (normal-mode memory is sized on the first dispatch).
        num_rdma_bytes: if non-zero, must cover the low-latency size hint of the first call.
        low_latency_mode: accepted; both modes work on any buffer.
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric,
            comm: accepted, no effect.
        enable_shrink: low-latency shrink mode (see :class:`tritonep.Buffer`).
        explicitly_destroy: accepted; :meth:`destroy` releases the memory either way.
        copy_combine_tokens, copy_combine_min_tokens: tritonep's own (default 0: off):
            combines of exact-size dispatches over copy engines, for calls of at most
            ``copy_combine_tokens`` tokens on every rank and at least
            ``copy_combine_min_tokens`` on some rank (see :class:`tritonep.Buffer`).

    Every method is that of :class:`tritonep.Buffer`: ``get_dispatch_layout``,
    ``dispatch``, ``combine``, ``low_latency_dispatch``, ``low_latency_combine``,
    ``get_next_low_latency_combine_buffer``, ``clean_low_latency_buffer``,
    ``get_low_latency_rdma_size_hint``, ``low_latency_update_mask_buffer``,
    ``low_latency_query_mask_buffer``, ``low_latency_clean_mask_buffer``, ``set_num_sms``,
    ``get_dispatch_config``, ``get_combine_config``, ``capture`` and ``destroy``, with
    DeepEP's signatures; and DeepEP's returns: within one node a dispatch's handle is a
    :class:`LegacyHandle` (DeepEP's tuple), and with ``num_worst_tokens > 0`` its per-expert
    counts are an empty list, as DeepEP returns them (they are on the device in the handle's
    ``host_info[1:]``).
    """

    #: SM budget of normal-mode calls (DeepEP's default).
    num_sms: int = 20
    #: A worst-case dispatch returns its per-expert counts as an empty list, as DeepEP does
    #: (they are on the device in the handle's ``host_info[1:]``).
    _empty_worst_counts = True

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: object = None,
        copy_combine_tokens: int = 0,
        copy_combine_min_tokens: int | None = None,
    ):
        super().__init__(
            group,
            num_nvl_bytes,
            num_rdma_bytes,
            low_latency_mode,
            num_qps_per_rank,
            explicitly_destroy,
            gpus_per_node=ranks_per_node(group),
            enable_shrink=enable_shrink,
            copy_combine_tokens=copy_combine_tokens,
            copy_combine_min_tokens=copy_combine_min_tokens,
        )

    def _new_normal_mode(self, hidden: int, num_experts: int):
        mode = super()._new_normal_mode(hidden, num_experts)
        if isinstance(mode, NormalMode):
            mode.handle_type = LegacyHandle.of_rank(self.rank)
        return mode

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: the kernels are compiled at run time for whatever GPU is present."""
        return True

    def get_comm_stream(self):
        """The ``torch.cuda.Stream`` normal-mode calls with ``async_finish`` or
        ``allocate_on_comm_stream`` run on (created here if no call has created it yet, on the
        current device); None on CPU ranks."""
        if not torch.cuda.is_available():
            return None
        return self._streams.comm_stream(torch.cuda.current_device())

    def internode_dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment: int = 1,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """:meth:`dispatch` (DeepEP's internal entry for groups that span nodes; here one
        method serves every group)."""
        return self.dispatch(
            x,
            handle,
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            topk_idx,
            topk_weights,
            expert_alignment,
            0,
            config,
            previous_event,
            async_finish,
            allocate_on_comm_stream,
        )

    def internode_combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """:meth:`combine` (DeepEP's internal entry for groups that span nodes)."""
        return self.combine(
            x,
            handle,
            topk_weights,
            bias,
            config,
            previous_event,
            async_finish,
            allocate_on_comm_stream,
        )

    def get_local_buffer_tensor(
        self,
        dtype: torch.dtype,
        size: torch.Size | None = None,
        offset: int = 0,
        use_rdma_buffer: bool = False,
    ) -> torch.Tensor:
        """Not provided: DeepEP hands out views of its one raw buffer, while here each mode
        lays out its own memory when first called. Raises ``NotImplementedError``."""
        raise NotImplementedError(
            "get_local_buffer_tensor: tritonep has no single raw buffer to view (each mode "
            "sizes its own memory on its first call)"
        )
