"""Triton kernels, one operation per module, each with a thin host wrapper.

* :mod:`.sync` -- acquire/release flags and bounded waits shared by every kernel;
* :mod:`.put_signal` -- store a block into a peer and raise a flag there.
"""
