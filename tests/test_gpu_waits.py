"""How a process waits for its GPU (`execution/gpu_waits.py`): CUDA's default unless ATTN_DOCTOR_GPU_WAIT=block,
then the device's primary context asked to sleep on waits, through the driver; a driver that cannot is no failure."""

from __future__ import annotations

import ctypes

import pytest

from attn_doctor.execution import gpu_waits


class _Driver:
    """libcuda's three entry points the module calls, recording them; `fails` makes that one answer 999."""

    def __init__(self, fails: str = "") -> None:
        self.calls: list[tuple] = []
        self.fails = fails

    def _answer(self, name: str) -> int:
        return 999 if name == self.fails else 0

    def cuInit(self, flags):
        self.calls.append(("cuInit", flags))
        return self._answer("cuInit")

    def cuDeviceGet(self, device_ref, index):
        ctypes.cast(device_ref, ctypes.POINTER(ctypes.c_int)).contents.value = 40 + index
        self.calls.append(("cuDeviceGet", index))
        return self._answer("cuDeviceGet")

    def cuDevicePrimaryCtxSetFlags(self, device, flags):
        self.calls.append(("cuDevicePrimaryCtxSetFlags", device.value, flags))
        return self._answer("cuDevicePrimaryCtxSetFlags")


@pytest.mark.parametrize("value, expected", [(None, "spin"), ("", "spin"), ("spin", "spin"), ("block", "block"),
                                             (" Block ", "block"), ("yes", "spin")])
def test_the_wait_is_read_from_the_environment(value, expected, monkeypatch):
    if value is None:
        monkeypatch.delenv(gpu_waits.WAIT_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(gpu_waits.WAIT_VARIABLE, value)
    assert gpu_waits.wanted() == expected


def test_by_default_the_driver_is_not_touched(monkeypatch):
    monkeypatch.delenv(gpu_waits.WAIT_VARIABLE, raising=False)
    driver = _Driver()
    monkeypatch.setattr(gpu_waits.ctypes, "CDLL", lambda name: driver)
    assert gpu_waits.apply(0) == "spin" and driver.calls == []


def test_block_sets_the_primary_context_of_that_device_to_sleep_on_waits(monkeypatch):
    monkeypatch.setenv(gpu_waits.WAIT_VARIABLE, "block")
    driver = _Driver()
    monkeypatch.setattr(gpu_waits.ctypes, "CDLL", lambda name: driver)
    assert gpu_waits.apply(2) == "block"
    assert driver.calls == [("cuInit", 0), ("cuDeviceGet", 2), ("cuDevicePrimaryCtxSetFlags", 42, 0x04)]


@pytest.mark.parametrize("fails", ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxSetFlags"])
def test_a_driver_that_refuses_leaves_cudas_default_and_says_so(fails, monkeypatch):
    monkeypatch.setenv(gpu_waits.WAIT_VARIABLE, "block")
    driver = _Driver(fails)
    monkeypatch.setattr(gpu_waits.ctypes, "CDLL", lambda name: driver)
    assert gpu_waits.apply(0) == "spin (the driver answered 999)"
    assert driver.calls[-1][0] == fails  # nothing after the refusal


def test_no_driver_at_all_is_no_failure(monkeypatch):
    monkeypatch.setenv(gpu_waits.WAIT_VARIABLE, "block")

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(gpu_waits.ctypes, "CDLL", missing)
    assert gpu_waits.apply(0).startswith("spin (libcuda.so.1")
