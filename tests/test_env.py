"""Tests for attn_doctor.machine.fingerprint, attn_doctor.machine.te_facts and attn_doctor.render.env_view (CPU-only)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time

import pytest
import torch

from attn_doctor.machine import fingerprint as env_mod
from attn_doctor.machine.fingerprint import EnvReport, Fact, GpuInfo, collect_env
from attn_doctor.machine.env_rows import env_rows
from attn_doctor.render.env_view import env_markdown, env_rich_table
from attn_doctor.machine.te_facts import decode_cudnn_version, loaded_te_facts

HAS_GPU = torch.cuda.is_available()
HAS_TE = importlib.util.find_spec("transformer_engine") is not None
HAS_FLASH = any(importlib.util.find_spec(m) is not None for m in ("flash_attn", "flash_attn_interface"))

FAKE_TE = {
    "te": "2.20.2",
    "te_core": "transformer-engine-cu13 2.20.2",
    "te_torch": "2.20.2",
    "te_cudnn": "9.14.0",
    "te_cudnn_int": 91400,
    "error": None,
}


@pytest.fixture
def no_probe(monkeypatch):
    """Fail loudly if a test that injects te_facts still spawns the probe."""

    def boom(*a, **k):
        raise AssertionError("TE probe must not be spawned")

    monkeypatch.setattr(env_mod, "_read_te_in_subprocess", boom)


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
def test_collect_env_without_gpu_never_raises():
    env = collect_env(read_te=False)
    assert env.gpus == ()
    assert env.gpus_note and "NVIDIA" in env.gpus_note
    assert env.driver.value is None
    assert env.driver.note and env.driver.note.startswith("no NVIDIA driver")
    assert env.cuda_available.value == "no"
    assert env.torch.value == torch.__version__
    assert env.te_cudnn == Fact(None, "not probed")


@pytest.mark.skipif(HAS_FLASH, reason="flash-attn is installed here")
def test_flash_attn_not_installed():
    env = collect_env(read_te=False)
    assert set(env.flash_attn) == {"v2", "v3", "v4"}
    for fact in env.flash_attn.values():
        assert fact == Fact(None, "not installed")


def test_env_var_filter(monkeypatch):
    monkeypatch.setenv("NVTE_FOO", "1")
    monkeypatch.setenv("CUDA_SECRET_TOKEN", "hunter2")
    monkeypatch.setenv("NCCL_API_KEY", "x")
    monkeypatch.setenv("HOME_UNRELATED_VAR", "y")
    env = collect_env(read_te=False)
    assert env.env_vars["NVTE_FOO"] == "1"
    assert "CUDA_SECRET_TOKEN" not in env.env_vars
    assert "NCCL_API_KEY" not in env.env_vars
    assert "HOME_UNRELATED_VAR" not in env.env_vars
    assert all(k.startswith(env_mod.ENV_PREFIXES) for k in env.env_vars)


def test_te_facts_injection(no_probe):
    env = collect_env(te_facts=dict(FAKE_TE))
    assert env.te == Fact("2.20.2")
    assert env.te_core == Fact("transformer-engine-cu13 2.20.2")
    assert env.te_torch == Fact("2.20.2")
    assert env.te_cudnn.value == "9.14.0 (91400)"


def test_cudnn_mismatch_flagged(monkeypatch, no_probe):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    env = collect_env(te_facts=dict(FAKE_TE))
    assert env.torch_cudnn.value == "9.19.0 (91900)"
    assert env.te_cudnn.value == "9.14.0 (91400)"
    assert env.te_cudnn.note and "differs" in env.te_cudnn.note and "9.19.0" in env.te_cudnn.note


def test_cudnn_same_version_not_flagged(monkeypatch, no_probe):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91400)
    env = collect_env(te_facts=dict(FAKE_TE))
    assert env.te_cudnn == Fact("9.14.0 (91400)")


def test_te_facts_with_import_error(no_probe):
    facts = {"te": "2.20.2", "te_core": None, "te_torch": None, "te_cudnn": None, "te_cudnn_int": None,
             "error": "RuntimeError: libcudnn shared object not found"}
    env = collect_env(te_facts=facts)
    assert env.te.value == "2.20.2"
    assert env.te_cudnn == Fact(None, "RuntimeError: libcudnn shared object not found")


@pytest.mark.skipif(HAS_TE, reason="Transformer Engine is installed here")
def test_subprocess_probe_without_te():
    env = collect_env(timeout_s=120)
    assert env.te == Fact(None, "not installed")
    assert env.te_cudnn.value is None
    assert "ModuleNotFoundError" in env.te_cudnn.note
    assert "transformer_engine" in env.te_cudnn.note


@pytest.mark.skipif(HAS_TE, reason="Transformer Engine is installed here")
def test_probe_loaded_te_without_te():
    facts = loaded_te_facts()
    assert set(facts) == {"te", "te_core", "te_torch", "te_cudnn", "te_cudnn_int", "te_cudnn_libraries", "error"}
    assert facts["te_cudnn"] is None and facts["te_cudnn_libraries"] is None
    assert facts["error"].startswith("ModuleNotFoundError")
    json.dumps(facts)


def test_probe_timeout(monkeypatch):
    monkeypatch.setattr(env_mod, "TE_FACTS_CMD", [sys.executable, "-c", "import time; time.sleep(30)"])
    t0 = time.monotonic()
    env = collect_env(timeout_s=1)
    assert time.monotonic() - t0 < 15
    assert env.te_cudnn.value is None
    assert "timed out" in env.te_cudnn.note


def test_probe_cmd_parameter_and_noisy_stdout():
    payload = json.dumps(FAKE_TE)
    code = f"print('noise from TE import'); print({{'not': 'json'}}); print({payload!r})"
    env = collect_env(te_facts_cmd=[sys.executable, "-c", code])
    assert env.te_cudnn.value == "9.14.0 (91400)"


def test_probe_crash_is_reported():
    code = "import sys; sys.stderr.write('Segmentation fault in libfoo\\n'); sys.exit(3)"
    env = collect_env(te_facts_cmd=[sys.executable, "-c", code])
    assert env.te_cudnn.value is None
    assert "code 3" in env.te_cudnn.note and "Segmentation fault in libfoo" in env.te_cudnn.note


def test_probe_cmd_missing_executable():
    env = collect_env(te_facts_cmd=["/nonexistent/python-for-attn-doctor"])
    assert env.te_cudnn.value is None
    assert "could not start" in env.te_cudnn.note


@pytest.mark.parametrize(
    ("encoded", "text"),
    [(91400, "9.14.0"), (91900, "9.19.0"), (90800, "9.8.0"), (90100, "9.1.0"), (8907, "8.9.7"), (8600, "8.6.0")],
)
def test_decode_cudnn_version(encoded, text):
    assert decode_cudnn_version(encoded) == text


def _sample_report() -> EnvReport:
    return EnvReport(
        python=Fact("3.12.3 (CPython)"),
        platform=Fact("Linux-x86_64"),
        driver=Fact("580.65"),
        gpus=(GpuInfo(0, "NVIDIA H200", "sm_90", 143771), GpuInfo(1, "NVIDIA H200", "sm_90", 143771)),
        gpus_note=None,
        torch=Fact("2.11.0+cu130"),
        torch_cuda=Fact("13.0"),
        torch_cudnn=Fact("9.19.0 (91900)"),
        cuda_available=Fact("yes"),
        te=Fact("2.20.2"),
        te_core=Fact("transformer-engine-cu13 2.20.2"),
        te_torch=Fact("2.20.2"),
        te_cudnn=Fact("9.14.0 (91400)", "differs from torch's cuDNN 9.19.0 | two libraries"),
        flash_attn={"v2": Fact("2.8.3"), "v3": Fact(None, "not installed"), "v4": Fact(None, "not installed")},
        env_vars={"NVTE_FUSED_ATTN": "1", "CUDA_VISIBLE_DEVICES": "0,1", "NVTE_WEIRD": "a|b"},
    )


def test_round_trip_sample():
    report = _sample_report()
    d = json.loads(json.dumps(report.to_dict()))
    assert EnvReport.from_dict(d) == report


def test_round_trip_collected(monkeypatch):
    monkeypatch.setenv("NVTE_FOO", "1")
    report = collect_env(te_facts=dict(FAKE_TE))
    assert EnvReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


def test_from_dict_tolerates_missing_keys():
    report = EnvReport.from_dict({"torch": {"value": "2.4.0", "note": None}})
    assert report.torch == Fact("2.4.0")
    assert report.te.value is None and report.te.note
    assert report.gpus == () and report.env_vars == {}


def test_env_rows_order_and_gpu_lines():
    rows = env_rows(_sample_report())
    labels = [label for label, _ in rows]
    assert labels[:5] == ["Python", "platform", "NVIDIA driver", "GPU 0", "GPU 1"]
    assert dict(rows)["GPU 0"] == "NVIDIA H200, sm_90, 143771 MiB"
    assert dict(rows)["flash-attn v3"] == "n/a (not installed)"
    assert labels.index("torch cuDNN") < labels.index("TE cuDNN") < labels.index("flash-attn v2")
    assert labels[-1] == "env vars"
    assert env_rows(_sample_report()) == rows  # stable


def _unescaped_pipes(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line))


@pytest.mark.parametrize("source", ["sample", "collected"])
def test_env_markdown_well_formed(source, monkeypatch):
    if source == "sample":
        report = _sample_report()
    else:
        monkeypatch.setenv("NVTE_PIPE", "x|y")
        report = collect_env(read_te=False)
    md = env_markdown(report)
    lines = md.strip("\n").split("\n")
    assert lines[0] == "| fact | value |"
    assert re.fullmatch(r"\|\s*-+\s*\|\s*-+\s*\|", lines[1])
    assert all(_unescaped_pipes(line) == 3 for line in lines)
    assert len(lines) == 2 + len(env_rows(report))
    env_line = next(line for line in lines if line.startswith("| env vars |"))
    for name in report.env_vars:
        assert name in env_line


def test_env_markdown_none_set():
    report = _sample_report()
    report = EnvReport.from_dict({**report.to_dict(), "env_vars": {}})
    env_line = next(line for line in env_markdown(report).splitlines() if line.startswith("| env vars |"))
    assert "*none set*" in env_line


def test_env_markdown_escapes_pipes():
    md = env_markdown(_sample_report())
    assert "NVTE_WEIRD=a\\|b" in md
    assert "cuDNN 9.19.0 \\| two libraries" in md


def test_env_rich_table_renders():
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(env_rich_table(_sample_report()))
    text = console.export_text()
    assert "NVIDIA H200, sm_90, 143771 MiB" in text
    assert "TE cuDNN" in text


class _FakeNvml:
    """A stand-in for pynvml with two H200s; GPU 1's memory query fails."""

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        pass

    class NVMLError_DriverNotLoaded(NVMLError):
        pass

    class _Mem:
        total = 143771 * 1024 * 1024

    def __init__(self, init_error: Exception | None = None):
        self.init_error = init_error
        self.shutdown_called = False

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdown_called = True

    def nvmlSystemGetDriverVersion(self):
        return b"580.159.03"  # older pynvml returned bytes

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H200"

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (9, 0)

    def nvmlDeviceGetMemoryInfo(self, h):
        if h == 1:
            raise self.NVMLError("Not Supported")
        return self._Mem()


def test_nvml_gpu_listing(monkeypatch):
    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    env = collect_env(read_te=False)
    assert env.driver == Fact("580.159.03")
    assert env.gpus[0] == GpuInfo(0, "NVIDIA H200", "sm_90", 143771)
    assert env.gpus[1].sm == "sm_90" and env.gpus[1].memory_total_mib == 0
    assert "GPU 1 memory: Not Supported" in env.gpus_note
    assert fake.shutdown_called
    assert dict(env_rows(env))["GPU 0"] == "NVIDIA H200, sm_90, 143771 MiB"


def test_nvml_driver_not_loaded(monkeypatch):
    fake = _FakeNvml(init_error=_FakeNvml.NVMLError_DriverNotLoaded("Driver Not Loaded"))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    env = collect_env(read_te=False)
    assert env.driver == Fact(None, "no NVIDIA driver: Driver Not Loaded")
    assert env.gpus == () and env.gpus_note == "no NVIDIA driver (NVML: Driver Not Loaded)"
