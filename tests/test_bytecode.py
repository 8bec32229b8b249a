"""core/bytecode.py: where torch has no bytecode beside its sources, a command and its processes read and write it
under a private prefix that a low-priority compiler fills at the command's start; elsewhere nothing changes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attn_doctor.core import bytecode, processes


@pytest.fixture
def clean_state(monkeypatch):
    """No prefix in use, none of the user's, and whatever a test starts ended."""
    monkeypatch.setattr(bytecode, "_prefix", None)
    monkeypatch.setattr(bytecode, "_compiler", None)
    monkeypatch.setattr(bytecode, "_outcome", None)
    monkeypatch.setattr(processes, "_for_children", {})
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.delenv(bytecode.VARIABLE, raising=False)
    saved = (sys.pycache_prefix, sys.dont_write_bytecode)
    yield
    bytecode.stop()
    sys.pycache_prefix, sys.dont_write_bytecode = saved


def _package(root: Path, name: str = "bcpkg") -> Path:
    """A package with a module and a test folder: `root/name`."""
    package = root / name
    (package / "tests").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import mod\n")
    (package / "mod.py").write_text("VALUE = 7\n")
    (package / "tests" / "test_mod.py").write_text("def test(): pass\n")
    return package


def test_a_prefix_only_where_torch_has_no_bytecode_beside_it(tmp_path, clean_state):
    source = tmp_path / "torch" / "__init__.py"
    source.parent.mkdir()
    source.write_text("")
    home = {bytecode.VARIABLE: str(tmp_path / "cache")}
    assert bytecode.wanted(str(source), home) == tmp_path / "cache"  # no __pycache__ beside: a prefix helps
    assert bytecode.wanted(None, home) is None  # no torch: nothing to compile
    assert bytecode.wanted(str(source), {**home, "PYTHONPYCACHEPREFIX": "/somewhere"}) is None  # the user's own
    assert bytecode.wanted(str(source), {bytecode.VARIABLE: "off"}) is None
    bytecode.beside(str(source)).parent.mkdir()
    bytecode.beside(str(source)).write_bytes(b"")
    assert bytecode.wanted(str(source), home) is None  # a usual install: a prefix would hide its bytecode


def test_the_folder_defaults_to_the_users_cache(clean_state):
    assert bytecode.folder({}) == Path.home() / ".cache" / "attn-doctor" / "bytecode"
    assert bytecode.folder({bytecode.VARIABLE: "~/bc"}) == Path.home() / "bc"
    assert bytecode.folder({bytecode.VARIABLE: "OFF"}) is None


def test_children_get_the_prefix_and_may_write_only_once_it_is_in_use(tmp_path, clean_state, monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert processes.child_env()["PYTHONDONTWRITEBYTECODE"] == "1"  # not in use: the environment as it is
    assert "PYTHONPYCACHEPREFIX" not in processes.child_env()
    bytecode.use(tmp_path / "prefix")
    assert processes.child_env()["PYTHONPYCACHEPREFIX"] == str(tmp_path / "prefix")
    assert "PYTHONDONTWRITEBYTECODE" not in processes.child_env()
    assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1"  # this process's own environment is left alone
    assert sys.pycache_prefix == str(tmp_path / "prefix") and not sys.dont_write_bytecode


def test_compilers_are_the_cores_the_imports_leave(clean_state):
    assert bytecode.compiler_processes(16) == 16 - bytecode.IMPORTING_AT_START
    assert bytecode.compiler_processes(2) == 0


def test_sources_come_in_import_order_without_tests(tmp_path, clean_state, monkeypatch):
    package = _package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = list(bytecode.sources(["bcpkg"]))
    stdlib = next(i for i, name in enumerate(found) if name.endswith(os.sep + "json" + os.sep + "__init__.py"))
    ours = found.index(str(Path(bytecode.__file__).resolve()))
    assert stdlib < ours < found.index(str(package / "mod.py"))
    assert not any(os.sep + "tests" + os.sep in name for name in found)


def test_sources_go_on_to_what_a_packages_distribution_requires(clean_state):
    found = list(bytecode.sources(["torch"]))  # torch requires sympy (its import loads much of it)
    assert len(found) == len(set(found))
    torch_init = next(i for i, name in enumerate(found) if name.endswith(os.sep.join(("torch", "__init__.py"))))
    sympy_init = next(i for i, name in enumerate(found) if name.endswith(os.sep.join(("sympy", "__init__.py"))))
    assert torch_init < sympy_init


def test_compile_all_writes_under_the_prefix_once_and_again_when_a_source_changes(tmp_path, clean_state,
                                                                                   monkeypatch):
    package = _package(tmp_path / "site")
    monkeypatch.setattr(bytecode, "sources", lambda packages: [str(package / "__init__.py"), str(package / "mod.py")])
    prefix = tmp_path / "prefix"
    first = bytecode.compile_all(str(prefix), 2, ["bcpkg"])
    assert (first["files"], first["compiled"]) == (2, 2)
    assert not (package / "__pycache__").exists()  # never beside the sources
    cached = prefix / str(package / "mod.py").lstrip(os.sep)
    cached = cached.parent / f"mod.{sys.implementation.cache_tag}.pyc"
    assert bytecode.up_to_date(str(package / "mod.py"), cached)
    assert bytecode.compile_all(str(prefix), 2, ["bcpkg"])["compiled"] == 0  # up to date: nothing again
    (package / "mod.py").write_text("VALUE = 8  # changed\n")
    os.utime(package / "mod.py", (time.time() + 5, time.time() + 5))
    assert not bytecode.up_to_date(str(package / "mod.py"), cached)
    assert bytecode.compile_all(str(prefix), 2, ["bcpkg"])["compiled"] == 1
    # a process under the prefix loads that bytecode, PYTHONDONTWRITEBYTECODE or not, and the change is seen
    loaded = subprocess.run([sys.executable, "-v", "-c", "import bcpkg; print(bcpkg.mod.VALUE)"],
                            capture_output=True, text=True, cwd=tmp_path / "site",
                            env={**os.environ, "PYTHONPYCACHEPREFIX": str(prefix), "PYTHONDONTWRITEBYTECODE": "1"})
    assert loaded.stdout.strip() == "8"
    assert f"code object from '{cached}'" in loaded.stderr


def test_up_to_date_refuses_a_foreign_or_missing_file(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("x = 1\n")
    assert not bytecode.up_to_date(str(source), tmp_path / "missing.pyc")
    (tmp_path / "junk.pyc").write_bytes(b"\0" * 16)
    assert not bytecode.up_to_date(str(source), tmp_path / "junk.pyc")


@pytest.mark.slow
def test_start_puts_the_command_under_the_prefix_and_the_compiler_says_what_it_did(tmp_path, clean_state,
                                                                                     monkeypatch):
    torch_init = tmp_path / "torch" / "__init__.py"
    torch_init.parent.mkdir()
    torch_init.write_text("")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: importlib.machinery.ModuleSpec(
        "torch", None, origin=str(torch_init)) if name == "torch" else real_find_spec(name, *rest))
    monkeypatch.setenv(bytecode.VARIABLE, str(tmp_path / "prefix"))
    monkeypatch.setattr(bytecode, "compiler_processes", lambda cores: 2)
    bytecode.start([])  # the standard library and attn_doctor only: seconds on two cores
    assert sys.pycache_prefix == str(tmp_path / "prefix")
    assert processes.child_env()["PYTHONPYCACHEPREFIX"] == str(tmp_path / "prefix")
    deadline = time.monotonic() + 120
    while bytecode.outcome() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    done = bytecode.outcome()
    assert done is not None and done["files"] > done["compiled"] > 100 and done["processes"] == 2
    # every source is now up to date there (some were written by the compiler's own imports, under the prefix too)
    for source in bytecode.sources([]):
        assert bytecode.up_to_date(source, Path(importlib.util.cache_from_source(source))), source


def test_start_does_nothing_where_torch_has_bytecode(clean_state, monkeypatch, tmp_path):
    torch_init = tmp_path / "torch" / "__init__.py"
    torch_init.parent.mkdir()
    torch_init.write_text("")
    bytecode.beside(str(torch_init)).parent.mkdir()
    bytecode.beside(str(torch_init)).write_bytes(b"")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: importlib.machinery.ModuleSpec(
        "torch", None, origin=str(torch_init)) if name == "torch" else real_find_spec(name, *rest))
    monkeypatch.setenv(bytecode.VARIABLE, str(tmp_path / "prefix"))
    bytecode.start(["torch"])
    assert bytecode._prefix is None and bytecode.outcome() is None and not (tmp_path / "prefix").exists()

