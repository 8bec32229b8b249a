"""Which cuDNN builds a machine has, and asking for one (issue 34), on fake library folders: a system folder
(version from the file name), a pip package (version from its metadata), a CUDNN_HOME folder with its header,
and a library compiled here that answers cudnnGetVersion() (version read from the library itself)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from attn_doctor.core.errors import BadInput
from attn_doctor.machine.cudnn_builds import (
    MAIN_PATTERN,
    WANTED_BUILD,
    CudnnBuild,
    find_builds,
    loaded_libraries,
    loader_environment,
    not_honoured,
    resolve,
    sonames,
    torch_preloads_wanted_build,
)

SUBS = ("libcudnn_graph", "libcudnn_ops", "libcudnn_engines_precompiled")


def _library_folder(folder: Path, full_version: str | None, major: str = "9") -> Path:
    """libcudnn.so.9 (-> libcudnn.so.9.x.y when a full version is given) and its sub-libraries, as empty files."""
    folder.mkdir(parents=True, exist_ok=True)
    soname = folder / f"libcudnn.so.{major}"
    if full_version:
        (folder / f"libcudnn.so.{full_version}").write_bytes(b"")
        soname.symlink_to(f"libcudnn.so.{full_version}")
    else:
        soname.write_bytes(b"")
    for sub in SUBS:
        (folder / f"{sub}.so.{major}").write_bytes(b"")
    return folder


def _pip_package(site: Path, version: str) -> Path:
    lib = _library_folder(site / "nvidia" / "cudnn" / "lib", None)
    info = site / f"nvidia_cudnn_cu13-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-cudnn-cu13\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"nvidia/cudnn/lib/{p.name},,\n" for p in sorted(lib.iterdir())))
    return lib


def _compiled(folder: Path, encoded: int) -> Path:
    """A libcudnn.so.9 whose cudnnGetVersion() returns `encoded` (a real shared library, built with gcc)."""
    folder.mkdir(parents=True)
    source = folder / "version.c"
    source.write_text(f"#include <stddef.h>\nsize_t cudnnGetVersion(void) {{ return {encoded}; }}\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "libcudnn.so.9"), str(source)], check=True)
    return folder


@pytest.fixture()
def machine(tmp_path):
    system = _library_folder(tmp_path / "usr" / "lib", "9.14.0")
    site = tmp_path / "site"
    pip_lib = _pip_package(site, "9.19.0.56")
    home = _library_folder(tmp_path / "cudnn-9.10" / "lib", None)
    include = tmp_path / "cudnn-9.10" / "include"
    include.mkdir()
    (include / "cudnn_version.h").write_text("#define CUDNN_MAJOR 9\n#define CUDNN_MINOR 10\n#define CUDNN_PATCHLEVEL 2\n")
    builds = find_builds({"CUDNN_HOME": str(tmp_path / "cudnn-9.10")}, [str(system)], [site])
    return builds, {"system": system, "pip": pip_lib, "home": home}


def test_every_build_is_found_with_its_version_and_where_that_came_from(machine):
    builds, where = machine
    found = {(b.version, b.version_from, b.origins) for b in builds}
    assert found == {("9.10.2", "header", ("CUDNN_HOME",)), ("9.14.0", "file name", ("system",)),
                     ("9.19.0", "package", ("pip nvidia-cudnn-cu13 9.19.0.56",))}
    assert [b.version for b in builds] == ["9.10.2", "9.14.0", "9.19.0"]  # by version
    system = next(b for b in builds if b.version == "9.14.0")
    assert system.directory == str(where["system"].resolve()) and system.library.endswith("libcudnn.so.9.14.0")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build a library")
def test_the_version_is_read_from_the_library_itself_where_it_loads(tmp_path):
    folder = _compiled(tmp_path / "real" / "lib", 91900)
    (build,) = find_builds({}, [str(folder)], [])
    assert (build.version, build.version_from) == ("9.19.0", "library")


def test_a_folder_that_cannot_be_read_is_skipped_not_an_error(tmp_path):
    assert find_builds({"CUDNN_HOME": str(tmp_path / "missing")}, [str(tmp_path / "nothing")], []) == []


def test_a_request_names_a_build_by_version_or_path(machine):
    builds, where = machine
    assert resolve("9.19.0", builds).version == "9.19.0"
    assert resolve("9.14", builds).version == "9.14.0"  # one build matches
    assert resolve(str(where["system"]), builds).version == "9.14.0"  # its folder
    assert resolve(str(where["pip"] / "libcudnn.so.9"), builds).version == "9.19.0"  # its library


def test_a_request_for_a_build_that_is_not_here_says_which_are(machine, tmp_path):
    builds, _ = machine
    with pytest.raises(BadInput) as missing:
        resolve("9.27.0", builds)
    assert "no such cuDNN build here" in str(missing.value)
    assert all(version in str(missing.value) for version in ("9.10.2", "9.14.0", "9.19.0"))
    with pytest.raises(BadInput, match="matches 3 builds"):
        resolve("9", builds)
    with pytest.raises(BadInput, match="no libcudnn.so there"):
        resolve(str(tmp_path), builds)


def test_a_worker_gets_every_lever_for_the_build_asked(machine):
    builds, where = machine
    pip = resolve("9.19.0", builds)
    env = loader_environment(pip, {"LD_LIBRARY_PATH": "/opt/other", "LD_PRELOAD": "/opt/libx.so"})
    assert env["CUDNN_HOME"] == env["CUDNN_PATH"] == pip.directory
    assert env["LD_LIBRARY_PATH"] == f"{pip.directory}:/opt/other"
    preloaded = env["LD_PRELOAD"].split(":")
    assert preloaded[0] == str(Path(pip.directory) / "libcudnn.so.9")  # the main library first
    assert {Path(p).name for p in preloaded[1:-1]} == {f"{sub}.so.9" for sub in SUBS} and preloaded[-1] == "/opt/libx.so"
    system = resolve("9.14.0", builds)
    assert Path(sonames(system)[0]).name == "libcudnn.so.9"  # the soname, not the fully versioned file
    assert env[WANTED_BUILD] == pip.directory


def test_torchs_preload_of_pips_cudnn_finds_the_wanted_build_and_nothing_else_changes(machine, monkeypatch):
    """What torch._preload_cuda_lib globs for (`<site>/nvidia/cudnn/lib/libcudnn.so.*[0-9]`) gives the wanted
    build's library inside `torch_preloads_wanted_build`, only where a build was asked for, and only then."""
    import glob

    builds, where = machine
    pattern = str(where["pip"] / MAIN_PATTERN)
    other = str(where["pip"] / "libcudnn_graph.so.*[0-9]")
    monkeypatch.setenv(WANTED_BUILD, str(where["system"]))
    with torch_preloads_wanted_build():
        wanted = sorted(str(p) for p in where["system"].glob("libcudnn.so.*") if p.name[-1].isdigit())
        assert glob.glob(pattern) == wanted
        assert glob.glob(other) == [str(where["pip"] / "libcudnn_graph.so.9")]  # other libraries as they are
        assert glob.glob(str(where["home"] / "nothing.so")) == []
    assert glob.glob(pattern) == [str(where["pip"] / "libcudnn.so.9")]  # restored
    monkeypatch.delenv(WANTED_BUILD)
    with torch_preloads_wanted_build():
        assert glob.glob(pattern) == [str(where["pip"] / "libcudnn.so.9")]


MAPS = """7f0000000000-7f0000001000 r-xp 00000000 08:01 11 {main}
7f0000001000-7f0000002000 r--p 00001000 08:01 11 {main}
7f0000002000-7f0000003000 r-xp 00000000 08:01 12 {graph}
7f0000003000-7f0000004000 rw-p 00000000 00:00 0
"""


def test_what_a_process_loaded_is_read_from_its_memory_map(machine):
    builds, where = machine
    maps = MAPS.format(main=where["system"] / "libcudnn.so.9.14.0", graph=where["system"] / "libcudnn_graph.so.9")
    assert loaded_libraries(maps) == [str(where["system"] / "libcudnn.so.9.14.0")]
    system, pip = resolve("9.14.0", builds), resolve("9.19.0", builds)
    loaded = loaded_libraries(maps)
    assert not_honoured(system, "9.14.0", loaded) is None
    assert "9.19.0 was asked for, and 9.14.0 was loaded" in not_honoured(pip, "9.14.0", loaded)
    assert "was asked for, and the process mapped" in not_honoured(pip, None, loaded)
    both = loaded + [str(Path(pip.directory) / "libcudnn.so.9")]
    assert "two cuDNN builds" in not_honoured(system, "9.14.0", both)


def test_a_build_round_trips_through_its_dict(machine):
    builds, _ = machine
    assert [CudnnBuild.from_dict(b.to_dict()) for b in builds] == builds


def test_env_lists_every_build_and_which_one_te_and_torch_load(machine, monkeypatch):
    """The fingerprint's "cuDNN builds" line: each build with its version, and the loaded files of TE's and
    torch's processes placed on their builds."""
    from attn_doctor.machine import cudnn_builds, fingerprint
    from attn_doctor.machine.env_rows import env_rows

    builds, where = machine
    monkeypatch.setattr(cudnn_builds, "find_builds", lambda: builds)
    seen, note = fingerprint._collect_cudnn_builds([str(where["system"] / "libcudnn.so.9.14.0")],
                                                  [str(where["pip"] / "libcudnn.so.9")])
    by_version = {build.version: build for build in seen}
    assert note is None and set(by_version) == {"9.10.2", "9.14.0", "9.19.0"}
    assert (by_version["9.14.0"].source, by_version["9.14.0"].loaded_by) == ("system", ("TE",))
    assert by_version["9.19.0"].source == "pip nvidia-cudnn-cu13 9.19.0.56"
    assert by_version["9.19.0"].loaded_by == ("torch",) and by_version["9.10.2"].loaded_by == ()
    assert by_version["9.14.0"].path == str(where["system"])
    env = dataclasses.replace(fingerprint.collect_env(read_te=False), cudnn_builds=seen, cudnn_builds_note=None)
    document = json.loads(json.dumps(env.to_dict()))  # env --json: a list of objects, not a sentence
    assert [b["version"] for b in document["cudnn_builds"]] == [b.version for b in seen]
    assert document["cudnn_builds"][0].keys() >= {"version", "path", "source", "loaded_by"}
    assert fingerprint.EnvReport.from_dict(document) == env
    line = dict(env_rows(env))["cuDNN builds"]
    assert "system): TE loads it" in line and "pip nvidia-cudnn-cu13 9.19.0.56): torch loads it" in line
    both = [str(where["pip"] / "libcudnn.so.9"), str(where["system"] / "libcudnn.so.9.14.0")]  # torch's mapped first
    seen, _ = fingerprint._collect_cudnn_builds(both, both[:1], te_version="9.14.0", torch_version="9.19.0")
    assert {b.version: b.loaded_by for b in seen} == {"9.10.2": (), "9.14.0": ("TE",), "9.19.0": ("torch",)}
    stray = fingerprint._collect_cudnn_builds(["/opt/other/libcudnn.so.9"], [])[0][-1]
    assert (stray.path, stray.source, stray.loaded_by) == ("/opt/other", "loaded, not found by the search", ("TE",))
    monkeypatch.setattr(cudnn_builds, "find_builds", lambda: [])
    assert fingerprint._collect_cudnn_builds([], []) == ((), "no libcudnn found (system folders, "
                                                             "CUDNN_HOME/CUDNN_PATH/CUDA_HOME/CUDA_PATH, pip)")
    env = fingerprint.collect_env(read_te=False)
    assert dict(env_rows(env))["cuDNN builds"].startswith("n/a (no libcudnn found")
    assert fingerprint.EnvReport.from_dict(env.to_dict()) == env
    older = {**env.to_dict(), "cudnn_builds": {"value": "9.14.0 (/lib; system): TE loads it", "note": None}}
    assert fingerprint.EnvReport.from_dict(older).cudnn_builds_note == "9.14.0 (/lib; system): TE loads it"


# --- asking for a build: --cudnn, the TE paths' processes, bisect's knob ------------------------------------

@pytest.fixture()
def here(machine, monkeypatch):
    """The fake machine's builds as the ones `find_builds()` finds."""
    from attn_doctor.bisect import knobs
    from attn_doctor.machine import cudnn_builds

    builds, where = machine
    monkeypatch.setattr(cudnn_builds, "find_builds", lambda *a, **k: builds)
    monkeypatch.setattr(knobs, "_cudnn_builds", lambda: tuple(builds))
    return builds, where


def test_each_te_path_runs_once_per_build_asked_in_a_process_of_its_own(here):
    from attn_doctor.backends import process_of, select, selector

    specs = select(["te.fused", "sdpa.math"], cudnn="9.14.0,9.19.0")
    assert [s.name for s in specs] == ["te.fused@cudnn-9.14.0", "te.fused@cudnn-9.19.0", "sdpa.math"]
    fused_old, fused_new, math = specs
    assert fused_new.options["cudnn"]["version"] == "9.19.0" and "cudnn" not in math.options
    keys = {process_of(spec)[0] for spec in specs}
    assert len(keys) == 3 and process_of(math) == ("sdpa", {})
    environment = process_of(fused_new)[1]
    assert environment["CUDNN_HOME"] == fused_new.options["cudnn"]["directory"]
    assert environment["LD_PRELOAD"].split(":")[0].endswith("libcudnn.so.9")
    assert selector(fused_new) == "--backend te.fused --cudnn 9.19.0"  # what re-runs the row


def test_te_refuses_a_row_whose_process_did_not_load_the_build_asked(here, monkeypatch):
    """Read back, never assumed: a TE process that reports another cuDNN makes the row SKIP, saying so."""
    from attn_doctor.backends import Unsupported, select
    from attn_doctor.backends import te as te_backend

    builds, where = here
    (spec,) = select(["te.fused"], cudnn="9.19.0")
    monkeypatch.setattr(te_backend, "_import_error", None)
    monkeypatch.setattr(te_backend, "_te_facts", {"te_cudnn": "9.14.0",
                                                  "te_cudnn_libraries": [str(where["system"] / "libcudnn.so.9.14.0")]})
    with pytest.raises(Unsupported, match="--cudnn not honoured by TE: cuDNN 9.19.0 was asked for, and 9.14.0"):
        te_backend.TEAttention(spec)


@pytest.mark.parametrize("args, words", [
    (["--backend", "te", "--cudnn", "9.27.0"], "no such cuDNN build here; found: 9.10.2"),
    (["--backend", "sdpa.math", "--cudnn", "9.14.0"], "none is selected"),
])
def test_a_cudnn_request_that_cannot_be_met_is_exit_2_with_the_builds_found(here, run_cli, args, words, tmp_path,
                                                                           monkeypatch):
    from cli_checks import one_line_error

    monkeypatch.chdir(tmp_path)
    for command in (["run", "--batch", "1", "--seq", "8", "--heads", "1", "--head-dim", "8"], ["sweep", "--seq", "8"]):
        line = one_line_error(run_cli([*command, *args, "--device", "cpu"]))
        assert words in line, line


def test_bisect_takes_the_cudnn_build_as_a_knob(here):
    """A TE path wrong with 9.10.2 and 9.14.0 and right with 9.19.0: bisect names the build as a necessary
    condition, and the report says where it starts and where it is fixed."""
    from attn_doctor.backends import select
    from attn_doctor.bisect.engine import Bisector, Outcome, valid_config
    from attn_doctor.bisect.knobs import coords_at
    from attn_doctor.core.case import make_case
    from attn_doctor.results.bisect_record import BisectRecord

    (spec,) = select(["te.fused"], cudnn="9.14.0")

    def probe(coords):
        fixed = coords.backend.options["cudnn"]["version"] == "9.19.0"
        return Outcome("PASS") if fixed else Outcome("FAIL", "dq: error 0.05", ("dq",))

    start = coords_at(make_case(batch=1, seq=4, heads=1, head_dim=8, dtype="fp32", mask="none"), backend=spec)
    result = Bisector(probe, valid=valid_config).run(start)
    assert {(c.knob, c.failing_value, c.passing_value) for c in result.necessary} == {("cudnn", "9.14.0", "9.19.0")}
    record = BisectRecord(None, result.start, result.minimal, result.necessary, result.steps, {}, "", None, [], None)
    assert record.cudnn_builds() == (["9.10.2", "9.14.0"], ["9.19.0"])
    assert record.cudnn_sentence() == "fails with cuDNN 9.10.2, 9.14.0, passes with 9.19.0: fixed by 9.19.0"
    # wrong on every build: no condition, and reproduced with each
    everywhere = Bisector(lambda c: Outcome("FAIL", "dq: error 0.05", ("dq",)), valid=valid_config).run(start)
    assert all(c.knob != "cudnn" for c in everywhere.necessary)
    record = BisectRecord(None, everywhere.start, everywhere.minimal, everywhere.necessary, everywhere.steps, {}, "",
                          None, [], None)
    assert record.cudnn_sentence() == "reproduced with cuDNN 9.10.2, 9.14.0 and 9.19.0"


def test_only_a_worker_started_as_the_machine_is_speaks_for_it():
    """A worker asked to load a cuDNN build reports that build's TE facts: they are the row's, not the machine's
    (a bisect with --cudnn 9.14.0 titled its issue with the 9.19.0 build its cudnn knob tried last)."""
    from attn_doctor.execution.pool import Worker
    from attn_doctor.execution.session import Session

    on_build = Worker("te", "cuda", 1.0, {WANTED_BUILD: "/usr/lib"})
    on_build.hello = {"family": "te", "pid": 1, "te_facts": {"te_cudnn": "9.19.0"}}
    session = Session("cuda")
    session.workers = {"te with cuDNN from /usr/lib": [on_build]}
    assert session.facts == {}
    plain = Worker("te", "cuda", 1.0, {})
    plain.hello = {"family": "te", "pid": 2, "te_facts": {"te_cudnn": "9.14.0"}}
    session.workers["te"] = [plain]
    assert session.facts == {"te_facts": {"te_cudnn": "9.14.0"}}


def test_a_probe_on_a_build_is_the_same_probe_once_read_back(machine, small_case):
    """A bisect's minimal case on a cuDNN build (its spec made here, tuples) is found among its rows (read back
    from JSON, lists): without that, an issue lost its bisect (the H100's --cudnn 9.14.0 bisects)."""
    from attn_doctor.backends import builtin_specs, on_build
    from attn_doctor.core.coords import Coords, coords_at, knob_dict

    builds, _ = machine
    spec = on_build(next(s for s in builtin_specs() if s.name == "te.fused"), builds[1])
    here = coords_at(small_case, "contiguous", 1, 0, spec)
    read_back = Coords.from_dict(json.loads(json.dumps(here.to_dict())))
    assert knob_dict(here) == knob_dict(read_back)
