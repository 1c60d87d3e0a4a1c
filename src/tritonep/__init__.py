"""tritonep: expert-parallel all-to-all (MoE dispatch and combine) in Python and Triton.

Layers, in the order data flows through them:

* :mod:`tritonep.heap` -- the symmetric heap (GPU symmetric memory, or CPU shared memory);
* :mod:`tritonep.kernels` -- the Triton kernels;
* :mod:`tritonep.modes` -- host-side orchestration (low-latency mode today);
* :mod:`tritonep.api` -- public APIs (a DeepEP-like ``Buffer``, the seed layers);
* :mod:`tritonep.reference` -- the pure-PyTorch oracle every kernel is tested against;
* :mod:`tritonep.torch_backend` -- the ``all_to_all_single`` baseline;
* :mod:`tritonep.launch` -- start N ranks (``python -m tritonep.launch -n N script.py``).
"""

__version__ = "0.1.0"
