"""tritonep: expert-parallel all-to-all (MoE dispatch and combine) in Python and Triton.

Layers, in the order data flows through them:

* :mod:`tritonep.heap` -- the symmetric heap (GPU symmetric memory, or CPU shared memory);
* :mod:`tritonep.kernels` -- the Triton kernels;
* :mod:`tritonep.modes` -- host-side orchestration: normal mode within a node and across
  nodes, low-latency mode, kernel traces;
* :mod:`tritonep.api` -- public APIs: a DeepEP-like ``Buffer``, the seed layers, autograd
  functions, serving adapters; :mod:`tritonep.deep_ep` -- DeepEP's own names and signatures;
* :mod:`tritonep.moe` -- an MoE layer on top, and its dense single-process twin.

Around them: :mod:`tritonep.reference` (the pure-PyTorch oracle every kernel is tested
against), :mod:`tritonep.torch_backend` (the ``all_to_all_single`` baseline),
:mod:`tritonep.launch` (start N ranks), :mod:`tritonep.bench` (``tritonep bench``),
:mod:`tritonep.soak` (randomized calls checked against the reference) and
:mod:`tritonep.costmodel` (predicted times across nodes).

Importing the package first decides whether this process's Triton kernels are compiled for the
GPU or run under Triton's interpreter (no usable GPU: ``TRITON_INTERPRET=1``), before any kernel
is defined (:mod:`tritonep.interpret`).
"""

from . import interpret as _interpret

_interpret.decide()

__version__ = "0.1.0"
