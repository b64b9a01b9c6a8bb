"""What becomes a one-line error (errors.py): an allocation that cannot be made, inside out_of_memory_names, is a
UserError naming the settings to lower; every other error passes through as it was."""

from __future__ import annotations

import pytest

from transformer.config import ModelConfig
from transformer.errors import UserError, is_out_of_memory, out_of_memory_names
from transformer.model import transformer as model_module

BIG = 10**14


def test_allocation_failure_names_the_setting(monkeypatch):
    monkeypatch.setattr(model_module, "_physical_memory", lambda: None)  # only the allocator can say no
    with pytest.raises(
        UserError,
        match=r"not enough memory for the positions table \(model.max_positions "
        r"100000000000000 x model.d_model 32\) \(",
    ):
        model_module.build_model(ModelConfig(d_model=32, n_heads=2, max_positions=BIG), 64)


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried..."),
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore details"),
        OverflowError("Python int too large to convert to C long"),
    ],
    ids=["MemoryError", "CPU allocator", "CUDA", "past int64"],
)
def test_an_allocation_failure_is_one_line_naming_what_to_lower(error):
    with pytest.raises(UserError) as raised:
        with out_of_memory_names("the batches (data.max_tokens)"):
            raise error
    message = str(raised.value)
    assert message.startswith("not enough memory for the batches (data.max_tokens) (") and "\n" not in message
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


@pytest.mark.parametrize(
    "error", [RuntimeError("mat1 and mat2 shapes cannot be multiplied"), ValueError("bad value"), KeyError("x")]
)
def test_other_errors_pass_through_unchanged(error):
    with pytest.raises(type(error)) as raised:
        with out_of_memory_names("the batches"):
            raise error
    assert raised.value is error and not is_out_of_memory(error)
