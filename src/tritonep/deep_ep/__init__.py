"""DeepEP's Python interface on tritonep: ``import tritonep.deep_ep as deep_ep``.

Code written for DeepEP's ``Buffer`` (the V1 API that vLLM, SGLang and Megatron-Core use) runs
unchanged: the same class and method names, argument names, defaults and return tuples,
shapes and dtypes. Names: :class:`Buffer`, :class:`Config`, :class:`EventOverlap`,
:class:`EventHandle` (also in :mod:`tritonep.deep_ep.utils`).

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
* with ``num_worst_tokens > 0`` the per-expert counts come as an ``[E_local]`` int32 device
  tensor (a list would need the host synchronization that mode avoids);
* configs asking for more ring slots than the buffer has get the buffer's ring (128 slots on
  GPUs); ``num_sms`` defaults to 20 as in DeepEP and must be even;
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
from ..modes.normal import Config
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap"]


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
