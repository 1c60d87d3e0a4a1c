"""What frameworks build on :class:`tritonep.Buffer`: each the interface its users already know.

* :mod:`.triton_distributed` -- Triton-distributed's layer interfaces:
  :class:`EPAll2AllLayer` (training and prefill: each local expert's rows contiguous, a token's
  copies reduced on their rank) and :class:`EPLowLatencyAllToAllLayer` (decode);
* :mod:`.serving` -- the call shapes serving frameworks wrap backends in:
  :class:`PrepareFinalize` (vLLM) and :class:`TwoPhaseDispatcher` (SGLang's two-batch overlap);
* :mod:`.autograd` -- normal-mode dispatch and combine as differentiable, ``torch.compile``-able
  operators, for training;
* :mod:`.moe` -- :class:`MoELayer` (router, experts, dispatch and combine) and
  :func:`~.moe.dense_moe`, its single-process twin.
"""

from . import autograd
from .moe import MoELayer
from .serving import PrepareFinalize, TwoPhaseDispatcher
from .triton_distributed import EPAll2AllLayer, EPLayoutDesc, EPLowLatencyAllToAllLayer

__all__ = [
    "EPAll2AllLayer",
    "EPLayoutDesc",
    "EPLowLatencyAllToAllLayer",
    "MoELayer",
    "PrepareFinalize",
    "TwoPhaseDispatcher",
    "autograd",
]
