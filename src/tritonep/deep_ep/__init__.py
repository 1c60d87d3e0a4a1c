"""DeepEP's Python interface on tritonep: ``import tritonep.deep_ep as deep_ep``.

Code written for DeepEP's ``Buffer`` (the V1 API that vLLM, SGLang and Megatron-Core use) runs
unchanged: the same class and method names, argument names, defaults and return tuples,
shapes and dtypes. Names: :class:`Buffer`, :class:`Config` (DeepEP's argument names and
defaults), :class:`EventOverlap`, :class:`EventHandle` (also in :mod:`tritonep.deep_ep.utils`)
and ``topk_idx_t`` (int64).

Behavioural differences, all documented here and in :mod:`tritonep.api.buffer`:

* normal mode runs on any number of ranks per node (DeepEP: 2, 4 or 8); a group whose ranks
  lie on several nodes (world rank ``r`` on node ``r // LOCAL_WORLD_SIZE``, as torchrun
  numbers them; the group's ranks node by node, as many on each) goes through
  :class:`~tritonep.modes.internode.InternodeMode` (both legs within reach of symmetric
  memory for now: one host or one NVLink domain, see ``docs/multinode.md``); the low-latency
  mode reaches other nodes through staging and NVSHMEM puts on NVSHMEM heaps
  (``tritonep.heap.set_backend("NVSHMEM")`` before the first call);
* each mode's memory is sized on its first call; ``num_nvl_bytes`` is accepted and need not
  be given, ``num_rdma_bytes`` (if given) must cover
  :meth:`Buffer.get_low_latency_rdma_size_hint`; later calls must keep the hidden size,
  expert count and (low-latency) ``num_max_dispatch_tokens_per_rank`` of the first;
* the normal-mode handle is a :class:`~tritonep.modes.normal.NormalHandle` rather than a
  tuple (code that only passes it back, as all integrations do, does not notice); the
  low-latency handle is a tuple whose first five items are DeepEP's (``src_info``,
  ``layout_range``, ``num_max_dispatch_tokens_per_rank``, ``hidden``, ``num_experts``);
* a cached dispatch (``handle=``) returns the handle again where DeepEP returns None, and
  rejects ``topk_idx``/``topk_weights`` with ``ValueError`` where DeepEP asserts;
* ``internode_dispatch`` and ``internode_combine`` are :meth:`Buffer.dispatch` and
  :meth:`Buffer.combine` (one method serves every group); ``get_local_buffer_tensor`` raises
  ``NotImplementedError`` (each mode sizes its own memory, there is no one raw buffer to
  view); the per-tensor FP8 arguments of some DeepEP branches
  (``use_per_tensor_quantization``, ``static_scale``) are not taken;
* with ``num_worst_tokens > 0`` the per-expert counts come as an ``[E_local]`` int32 device
  tensor (a list would need the host synchronization that mode avoids);
* configs asking for more ring slots than the buffer has get the buffer's ring (128 slots on
  GPUs); ``num_sms`` defaults to 20 as in DeepEP and must be even; chunk sizes are honoured
  as given, though DeepEP's tuned 6-token chunks are slower here than the 16 of
  :meth:`Buffer.get_dispatch_config`;
* normal-mode FP8 scales may be any 4-byte words per token (float32 or int32, any strides),
  copied unchanged as in DeepEP, up to ``H / 32`` per token;
* low-latency FP8 scales come column-major per expert as in DeepEP (packed UE8M0 int32 with
  ``use_ue8m0``, which here implies ``round_scale``); ``use_logfmt`` sends DeepEP's
  LogFMT-10 (same rule, own bit layout; also with ``zero_copy``; on NVLink about 2.5x
  BF16's time, with a warning); any
  hidden size that is a multiple of 128 and any top-k up to 16 work in low-latency mode
  (DeepEP: a fixed list of hidden sizes, multiples of 512 with FP8, top-k <= 11);
* the ``*_wait_recv_cost_stats`` tensors accumulate nanoseconds (DeepEP: cycles);
* ``num_qps_per_rank``,
  ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``use_fabric`` and ``comm`` are
  accepted and have no effect;
* ``enable_shrink`` works as in DeepEP (a low-latency wait that times out masks the rank;
  ``low_latency_update_mask_buffer``, ``low_latency_query_mask_buffer`` and
  ``low_latency_clean_mask_buffer``), except that nothing is printed: query the mask;
* a wait that times out (100 s by default) raises
  :class:`~tritonep.errors.WaitTimeoutError` from :meth:`Buffer.check` or
  :meth:`Buffer.destroy` instead of trapping the GPU (in low-latency shrink mode it masks
  the rank instead); later calls of that mode give up their waits at once, and the buffer is
  to be destroyed and built again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..api.buffer import Buffer as _Buffer
from ..api.buffer import ranks_per_node
from ..modes.normal import Config as _Config
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]

#: The dtype of top-k expert ids (DeepEP's ``deep_ep.topk_idx_t``).
topk_idx_t = torch.int64


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


class Buffer(_Buffer):
    """DeepEP's ``Buffer``: one communication buffer per expert-parallel group.

    Args:
        group: the process group; every rank constructs the buffer together.
        num_nvl_bytes: accepted (normal-mode memory is sized on the first dispatch).
        num_rdma_bytes: if non-zero, must cover the low-latency size hint of the first call.
        low_latency_mode: accepted; both modes work on any buffer.
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric,
            comm: accepted, no effect.
        enable_shrink: low-latency shrink mode (see :class:`tritonep.api.Buffer`).
        explicitly_destroy: accepted; :meth:`destroy` releases the memory either way.

    Every method is that of :class:`tritonep.api.Buffer`: ``get_dispatch_layout``,
    ``dispatch``, ``combine``, ``low_latency_dispatch``, ``low_latency_combine``,
    ``get_next_low_latency_combine_buffer``, ``clean_low_latency_buffer``,
    ``get_low_latency_rdma_size_hint``, ``low_latency_update_mask_buffer``,
    ``low_latency_query_mask_buffer``, ``low_latency_clean_mask_buffer``, ``set_num_sms``,
    ``get_dispatch_config``, ``get_combine_config``, ``capture`` and ``destroy``, with
    DeepEP's signatures.
    """

    #: SM budget of normal-mode calls (DeepEP's default).
    num_sms: int = 20

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
    ):
        super().__init__(
            group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
            explicitly_destroy, gpus_per_node=ranks_per_node(group), enable_shrink=enable_shrink,
        )  # fmt: skip

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: the kernels are compiled at run time for whatever GPU is present."""
        return True

    def get_comm_stream(self):
        """The ``torch.cuda.Stream`` normal-mode kernels run on (created here if no call has
        created it yet, on the current device); None on CPU ranks."""
        if self._comm_stream is None and torch.cuda.is_available():
            self._comm_stream = torch.cuda.Stream(torch.cuda.current_device())
        return self._comm_stream

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
            x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, 0, config,
            previous_event, async_finish, allocate_on_comm_stream,
        )  # fmt: skip

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
            x, handle, topk_weights, bias, config, previous_event, async_finish,
            allocate_on_comm_stream,
        )  # fmt: skip

    def get_local_buffer_tensor(
        self, dtype: torch.dtype, size: torch.Size | None = None, offset: int = 0,
        use_rdma_buffer: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Not provided: DeepEP hands out views of its one raw buffer, while here each mode
        lays out its own memory when first called. Raises ``NotImplementedError``."""
        raise NotImplementedError(
            "get_local_buffer_tensor: tritonep has no single raw buffer to view (each mode "
            "sizes its own memory on its first call)"
        )
