"""device.py: what `auto` means on this CPU, and the override that lets the suite run as on another CPU."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import cli, subprocess_env
from transformer import device as device_module
from transformer.config import from_dict
from transformer.device import NATIVE_BF16_VARIABLE, pick_precision
from transformer.errors import UserError


def test_the_override_decides_native_bf16_whatever_the_cpu_reports(monkeypatch):
    cpu = torch.device("cpu")
    for flags in ([], ["amx_bf16"]):
        monkeypatch.setattr(device_module, "cpu_bf16_flags", lambda flags=flags: flags)
        monkeypatch.setenv(NATIVE_BF16_VARIABLE, "1")
        assert pick_precision("auto", cpu) == ("bf16", f"auto: {NATIVE_BF16_VARIABLE}=1")
        monkeypatch.setenv(NATIVE_BF16_VARIABLE, "0")
        assert pick_precision("auto", cpu) == ("fp32", f"auto: {NATIVE_BF16_VARIABLE}=0")
        assert pick_precision("bf16", cpu)[0] == "bf16"  # an explicit choice stays
    monkeypatch.setenv(NATIVE_BF16_VARIABLE, "yes")
    with pytest.raises(UserError, match=f"{NATIVE_BF16_VARIABLE} must be 1 .* or 0, got 'yes'"):
        pick_precision("auto", cpu)


def test_a_child_process_sees_the_override(run):
    """The suite's child processes (the CLI run as a user runs it) pick what the override says."""
    for forced, dtype in (("1", "bf16"), ("0", "fp32")):
        result = cli(
            "translate", str(run), "--device", "cpu", "ein hund", env=subprocess_env(**{NATIVE_BF16_VARIABLE: forced})
        )
        assert result.returncode == 0, result.stderr
        assert f"dtype: {dtype} (auto: {NATIVE_BF16_VARIABLE}={forced})" in result.stderr


def test_precision_auto_is_bf16_only_where_the_hardware_has_it(monkeypatch, cpu_with_bf16_flags):
    cpu = torch.device("cpu")
    cpu_with_bf16_flags([])
    assert pick_precision("auto", cpu) == ("fp32", "auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16)")
    cpu_with_bf16_flags(["amx_bf16"])
    assert pick_precision("auto", cpu) == ("bf16", "auto: this CPU has amx_bf16")
    assert pick_precision("fp32", cpu)[0] == "fp32"  # an explicit choice stays
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation)
    assert pick_precision("auto", torch.device("cuda"))[0] == "bf16"
    with pytest.raises(UserError, match="fp16' needs CUDA"):
        pick_precision("fp16", cpu)
    assert from_dict({}).train.precision == "auto"
