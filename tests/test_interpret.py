"""The Triton backend of a process: the interpreter exactly where no GPU is usable, an explicit
setting kept, and a clear error (what to do) where kernels cannot run on a rank's device."""

import os

import numpy
import pytest
import torch
import triton

from tritonep import interpret
from tritonep.launch import _cpu_rank_environment

DECISIONS = [
    # TRITON_INTERPRET before, a GPU usable, TRITON_INTERPRET after
    (None, False, "1"),
    (None, True, None),
    ("", False, "1"),
    ("0", False, "0"),
    ("1", True, "1"),
    ("true", False, "true"),
]


@pytest.mark.parametrize("setting, gpu, after", DECISIONS)
def test_the_interpreter_is_on_where_no_gpu_is_usable_unless_set(monkeypatch, setting, gpu, after):
    if setting is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", setting)
    monkeypatch.setattr(interpret, "gpu_present", lambda: gpu)
    interpret.decide()
    assert os.environ.get("TRITON_INTERPRET") == after


def test_kernels_that_cannot_run_on_a_ranks_device_say_what_to_do(monkeypatch):
    # No kernel defined yet: TRITON_INTERPRET decides how they will be built.
    monkeypatch.setattr(interpret, "_kernel_modules", lambda: [])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=0 is set.*unset TRITON_INTERPRET"):
        interpret.check(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match=r"runs on cuda:0.*CPU ranks only"):
        interpret.check(torch.device("cuda", 0))
    monkeypatch.undo()
    # Kernels defined: how they were built decides, whatever is set afterwards.
    import tritonep.kernels.put_signal  # noqa: F401

    built_for_interpreter = torch.cuda.device_count() == 0  # as this suite defines them
    assert interpret.kernels_defined() and interpret.interpreting() == built_for_interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0" if built_for_interpreter else "1")
    assert interpret.interpreting() == built_for_interpreter
    interpret.check(torch.device("cpu") if built_for_interpreter else torch.device("cuda", 0))


def test_a_cpu_rank_of_a_gpu_machine_turns_the_interpreter_on_before_its_kernels(monkeypatch):
    """A rank that learns it runs on the CPU (more ranks than GPUs) while no kernel is defined
    yet turns the interpreter on; with kernels defined it can no longer switch, and says how to
    start it instead."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(interpret, "kernels_defined", lambda: False)
    interpret.use_for_cpu_ranks()
    assert os.environ["TRITON_INTERPRET"] == "1"
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(interpret, "kernels_defined", lambda: True)
    monkeypatch.setattr(interpret, "interpreting", lambda: False)
    interpret.use_for_cpu_ranks()
    assert "TRITON_INTERPRET" not in os.environ
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1 before Python starts"):
        interpret.check(torch.device("cpu"))


@pytest.mark.parametrize(
    "triton_version, numpy_version, trapped",
    [("3.6.0", "2.4.1", True), ("3.6.0", "2.3.5", False), ("3.7.1", "2.4.1", False)],
)
def test_triton_36s_interpreter_beside_numpy_24_is_named(
    monkeypatch, triton_version, numpy_version, trapped
):
    monkeypatch.setattr(interpret, "_kernel_modules", lambda: [])  # none built yet
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    if trapped:
        with pytest.raises(RuntimeError, match=r"needs numpy < 2.4.*pip install 'numpy<2.4'"):
            interpret.check(torch.device("cpu"))
    else:
        interpret.check(torch.device("cpu"))


def test_ranks_started_on_the_cpu_get_the_interpreter_in_their_environment(monkeypatch):
    """What ranks that run on the CPU of a GPU machine inherit; the parent's own setting comes
    back once they have started."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with _cpu_rank_environment(on_cpu=True):
        assert os.environ["TRITON_INTERPRET"] == "1"
    assert "TRITON_INTERPRET" not in os.environ
    with _cpu_rank_environment(on_cpu=False):
        assert "TRITON_INTERPRET" not in os.environ
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a user's setting is theirs
    with _cpu_rank_environment(on_cpu=True):
        assert os.environ["TRITON_INTERPRET"] == "0"
