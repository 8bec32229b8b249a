"""TE releases prepared side by side (`attn_doctor/machine/te_installs.py`, `attn-doctor te`), and `--te` choosing
one: discovery, the refusal, an install that fails leaving nothing behind, what a worker imported read back. Fake
installs stand in for TE (a folder with an install record and a stand-in `transformer_engine` package); the real
releases on a GPU are in reports/."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from attn_doctor.core.errors import BadInput
from attn_doctor.machine import te_installs
from attn_doctor.machine.te_installs import TEInstall, find_installs, resolve
from cli_checks import one_line_error


# The stand-in `transformer_engine.pytorch` loads its torch extension as TE does: from its own folder's wheel_lib/.
_LOADS_EXTENSION = """\
import importlib.util, pathlib, sys
_found = pathlib.Path(__file__).parents[1] / "wheel_lib" / "transformer_engine_torch.py"
if _found.exists():
    _spec = importlib.util.spec_from_file_location("transformer_engine_torch", _found)
    sys.modules["transformer_engine_torch"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["transformer_engine_torch"])
"""


def _fake_te(site: Path, version: str, extension: bool = True) -> None:
    """A stand-in `transformer_engine` of `version` in `site` (what pip would have put there), its torch extension
    in `transformer_engine/wheel_lib/` where `extension`."""
    package = site / "transformer_engine"
    (package / "pytorch").mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (package / "pytorch" / "__init__.py").write_text(_LOADS_EXTENSION)
    if extension:
        (package / "wheel_lib").mkdir(exist_ok=True)
        (package / "wheel_lib" / "transformer_engine_torch.py").write_text("")


def _prepared(home: Path, version: str, torch_version: str = "2.11.0+cu130") -> TEInstall:
    folder = home / version
    _fake_te(folder / "site", version)
    (folder / "install.json").write_text(json.dumps({"version": version, "torch": torch_version, "cuda": "13.0",
                                                     "python": "3.12.3"}))
    return TEInstall(version, str(folder), torch_version, "13.0", "3.12.3")


@pytest.fixture
def home(tmp_path, monkeypatch):
    folder = tmp_path / "te-home"
    folder.mkdir()
    monkeypatch.setenv(te_installs.HOME_VARIABLE, str(folder))
    return folder


def test_the_prepared_releases_are_found_and_half_made_or_unreadable_folders_are_not(home):
    _prepared(home, "2.20.2")
    _prepared(home, "2.9.0")
    (home / ".partial-2.18.0-99" / "site").mkdir(parents=True)  # being made, or left by a failure
    (home / "2.17.0" / "site").mkdir(parents=True)  # no record
    (home / "2.16.0").mkdir()
    (home / "2.16.0" / "install.json").write_text("{not json")
    assert [install.version for install in find_installs()] == ["2.9.0", "2.20.2"]  # by version, not by name
    assert find_installs(home / "nowhere") == []
    value, note = te_installs.installs_fact()
    assert "2.9.0 (built for torch 2.11.0+cu130, CUDA 13.0" in value and str(home) in note
    assert te_installs.installs_fact(home=home / "nowhere")[0] is None


def test_a_release_not_prepared_is_refused_naming_those_that_are(home):
    installs = [_prepared(home, "2.20.2")]
    assert resolve("2.20.2", installs).version == "2.20.2"
    with pytest.raises(BadInput) as refused:
        resolve("2.18.0", installs)
    assert "prepared: 2.20.2" in str(refused.value) and "attn-doctor te add 2.18.0" in str(refused.value)
    with pytest.raises(BadInput, match=r"prepared: none"):
        resolve("2.18.0", [])


def test_pip_installs_the_release_into_its_folder_alone_its_extension_built_against_its_own_core(tmp_path):
    """Built against the release's own core in a build folder; then the three packages into the release's folder in
    one install: pip's --target skips a folder that is already there, so the extension (in the one
    `transformer_engine/wheel_lib/`) installed after the others was left out (the H100, TE 2.18.0)."""
    site = tmp_path / "partial" / "site"
    core, build, extension = te_installs.pip_commands("2.18.0", site, tmp_path / "wheels", "13.0")
    for command in (core, build, extension):
        assert command[:3] == [sys.executable, "-m", "pip"] and "--no-deps" in command
    assert core[3] == "install" and core[core.index("--target") + 1] == str(te_installs.build_site(site)) != str(site)
    assert {"transformer-engine==2.18.0", "transformer-engine-cu13==2.18.0"} <= set(core)
    assert "--no-index" in core and str(tmp_path / "wheels") in core
    assert build[3] == "wheel" and "--no-build-isolation" in build and "transformer-engine-torch==2.18.0" in build
    built = build[build.index("--wheel-dir") + 1]
    assert built in extension and extension[extension.index("--target") + 1] == str(site)
    assert {"transformer-engine==2.18.0", "transformer-engine-cu13==2.18.0", "transformer-engine-torch==2.18.0"} <= set(
        extension)
    assert all("--no-index" not in command for command in te_installs.pip_commands("2.18.0", site, None, "12.8")[:2])
    assert "transformer-engine-cu12==2.18.0" in te_installs.pip_commands("2.18.0", site, None, "12.8")[0]
    environment = te_installs.build_environment(site, {"PYTHONPATH": "/elsewhere"})
    assert environment["PYTHONPATH"] == f"{site}:/elsewhere"  # the release's core first, for the build
    assert environment["NVTE_PYTORCH_FORCE_BUILD"] == "TRUE" and environment["NVTE_FRAMEWORK"] == "pytorch"
    with pytest.raises(BadInput, match="no CUDA"):
        te_installs.core_package(None)


def _runner(version_installed: str, pip_fails: str | None = None, extension: bool = True):
    """pip stood in (it writes a stand-in TE of `version_installed`, with the torch extension where the command
    installs it and `extension`, or fails with `pip_fails`); the import check run for real, in a fresh
    interpreter."""
    def run(command, env):
        if command[1:3] == ["-m", "pip"]:
            if pip_fails and command[3] == "wheel":  # the extension's build, as it fails
                return subprocess.CompletedProcess(command, 1, "", f"Building x\n{pip_fails}\n")
            if "--target" in command:
                _fake_te(Path(command[command.index("--target") + 1]), version_installed,
                         extension=extension and "transformer-engine-torch==2.18.0" in command)
            return subprocess.CompletedProcess(command, 0, "", "")
        return subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    return run


def test_an_install_is_checked_by_importing_it_and_recorded_with_what_it_was_built_against(home, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    install, made = te_installs.add("2.18.0", home=home, runner=_runner("2.18.0"))
    assert made and install.version == "2.18.0" and install.torch == torch.__version__
    assert Path(install.site, "transformer_engine").is_dir()
    assert json.loads((home / "2.18.0" / "install.json").read_text())["torch"] == torch.__version__
    assert [p.name for p in home.iterdir()] == ["2.18.0"]  # nothing half-made beside it
    again, made = te_installs.add("2.18.0", home=home, runner=_runner("9.9.9"))
    assert not made and again == find_installs(home)[0]


@pytest.mark.parametrize("failure", ["pip", "import", "extension"])
def test_an_install_that_fails_is_refused_with_its_last_error_line_and_leaves_nothing(home, monkeypatch, failure):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    runner = {"pip": _runner("2.18.0", pip_fails="ERROR: Failed building wheel for transformer-engine-torch"),
              "import": _runner("2.17.0"),  # the folder holds another version than asked
              "extension": _runner("2.18.0", extension=False),  # its own torch extension missing from its folder
              }[failure]
    with pytest.raises(BadInput) as refused:
        te_installs.add("2.18.0", home=home, runner=runner)
    said = str(refused.value)
    if failure == "pip":
        assert "Failed building wheel for transformer-engine-torch" in said and torch.__version__ in said
    elif failure == "import":
        assert "imported TE 2.17.0" in said
    else:
        assert "its torch extension from nowhere" in said
    assert list(home.iterdir()) == [] and find_installs(home) == []


def test_te_add_on_the_command_line_refuses_in_one_line_and_te_list_and_env_show_the_prepared(
        home, tmp_path, monkeypatch, run_cli):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    result = run_cli(["te", "add", "2.18.0", "--from", str(empty)])  # real pip, no index, no wheels: it fails
    line = one_line_error(result)
    assert result.exit_code == 2 and "attn-doctor te add 2.18.0: pip could not install it" in line
    assert list(home.iterdir()) == []
    assert run_cli(["te", "add", "two"]).exit_code == 2
    listed = run_cli(["te", "list"])
    assert listed.exit_code == 0 and "No TE release prepared" in listed.output
    _prepared(home, "2.20.2")
    assert "TE 2.20.2 (built for torch 2.11.0+cu130" in run_cli(["te", "list"]).output
    shown = run_cli(["env", "--json", "--no-te"])
    assert "2.20.2 (built for torch" in json.loads(shown.output)["te_installs"]["value"]


def test_te_picks_the_release_each_te_path_runs_and_names_the_rows_for_it(home, run_cli, tmp_path):
    from attn_doctor.backends import process_of, select, selector

    _prepared(home, "2.18.0")
    _prepared(home, "2.20.2")
    specs = select(["te.fused", "local"], te="2.18.0,2.20.2", cudnn=None)
    assert [spec.name for spec in specs] == ["te.fused@te-2.18.0", "te.fused@te-2.20.2", "local"]
    key, environment = process_of(specs[0])
    assert key == "te with TE 2.18.0" and environment[te_installs.SITE_VARIABLE] == str(home / "2.18.0" / "site")
    assert process_of(specs[2]) == ("local", {})
    assert selector(specs[0]) == "--backend te.fused --te 2.18.0"
    with pytest.raises(BadInput, match="none is selected"):
        select(["local"], te="2.18.0")
    refused = run_cli(["run", "--te", "2.17.0", "--backend", "te.fused", "--device", "cpu"])
    assert refused.exit_code == 2 and "prepared: 2.18.0, 2.20.2" in one_line_error(refused)
    out = tmp_path / "run.json"
    ran = run_cli(["run", "--te", "2.18.0", "--backend", "te.fused", "--backend", "local", "--device", "cpu",
                   "--batch", "1", "--seq", "32", "--heads", "2", "--head-dim", "16", "--json", str(out)])
    assert ran.exit_code == 0, ran.output
    rows = json.loads(out.read_text())["results"]
    assert {row["backend"] for row in rows} == {"te.fused@te-2.18.0", "local"}
    assert next(row for row in rows if row["backend"] == "te.fused@te-2.18.0")["verdict"] == "SKIP"  # on the CPU


def test_a_worker_puts_the_release_first_on_its_path_and_reads_back_what_it_imported(tmp_path, monkeypatch):
    install = TEInstall("2.18.0", str(tmp_path / "2.18.0"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert te_installs.use_prepared_release({te_installs.SITE_VARIABLE: install.site}) == install.site
    assert sys.path[0] == install.site
    assert te_installs.use_prepared_release({}) is None
    inside = str(Path(install.site) / "transformer_engine" / "__init__.py")
    assert te_installs.release_not_honoured(install, "2.18.0", inside) is None
    assert "imported TE 2.20.2 from /usr/lib" in te_installs.release_not_honoured(
        install, "2.20.2", "/usr/lib/python3/transformer_engine/__init__.py")
    assert "its folder holds TE 2.17.0" in te_installs.release_not_honoured(install, "2.17.0", inside)
    own_extension = str(Path(install.site) / "transformer_engine" / "wheel_lib" / "transformer_engine_torch.so")
    assert te_installs.release_not_honoured(install, "2.18.0", inside, own_extension) is None
    elsewhere = "/env/site-packages/transformer_engine/wheel_lib/transformer_engine_torch.so"
    assert "loaded the torch extension /env/site-packages" in te_installs.release_not_honoured(
        install, "2.18.0", inside, elsewhere)


def test_a_te_path_whose_worker_imported_another_release_is_a_skip_saying_so(monkeypatch, tmp_path):
    from attn_doctor.backends import BackendSpec, te as te_backend

    install = TEInstall("2.18.0", str(tmp_path / "2.18.0"))
    spec = BackendSpec("te.fused@te-2.18.0", "te", {"path": "fused", "te": install.to_dict()})
    monkeypatch.setattr(te_backend, "_import_error", None)
    monkeypatch.setattr(te_backend, "_te_facts", {"te": "2.20.2", "te_cudnn": None, "te_cudnn_libraries": []})
    monkeypatch.setitem(sys.modules, "transformer_engine",
                        types.SimpleNamespace(__file__="/env/site-packages/transformer_engine/__init__.py"))
    with pytest.raises(te_backend.Unsupported, match="--te not honoured: asked for TE 2.18.0"):
        te_backend.TEAttention(spec)


def test_a_known_defect_s_te_versions_are_checked_on_the_release_the_row_ran_not_the_machine_s():
    """A rule with `te = "<2.19"` holds for a `--te 2.18.0` row on a machine whose own TE is 2.20.2, and not for
    that machine's own rows."""
    from attn_doctor.known_defects.conditions import CONDITIONS
    from attn_doctor.known_defects.facts import Facts, MatchContext
    from attn_doctor.machine.fingerprint import EnvReport, Fact

    env = EnvReport.from_dict({"te": {"value": "2.20.2"}})
    check = next(condition for condition in CONDITIONS if condition.key == "te").check
    own = Facts(env, MatchContext.from_env(env, te="2.18.0"), None, {"te": "<2.19"})
    machine = Facts(env, MatchContext.from_env(env), None, {"te": "<2.19"})
    assert check("<2.19", own).matched and "the path's own" in check("<2.19", own).label
    assert not check("<2.19", machine).matched


def test_bisect_takes_the_te_release_as_a_knob_and_says_where_it_is_fixed(home):
    """A TE path wrong on 2.18.0 and right on 2.20.2: the release is a necessary condition, and the bisect's record
    says "fixed by 2.20.2"; wrong on both, it says it is reproduced with each. The probe's record keeps the
    release, so a document read back rebuilds the same path."""
    from attn_doctor.backends import select
    from attn_doctor.bisect import knobs
    from attn_doctor.bisect.engine import Bisector, Outcome, valid_config
    from attn_doctor.core.case import make_case
    from attn_doctor.core.coords import knob_dict
    from attn_doctor.results.bisect_record import BisectRecord, _coords

    _prepared(home, "2.18.0")
    _prepared(home, "2.20.2")
    knobs._te_releases.cache_clear()
    (spec,) = select(["te.fused"], te="2.18.0")

    def probe(coords):
        fixed = coords.backend.options["te"]["version"] == "2.20.2"
        return Outcome("PASS") if fixed else Outcome("FAIL", "dq: error 0.05", ("dq",))

    start = knobs.coords_at(make_case(batch=1, seq=4, heads=1, head_dim=8, dtype="fp32", mask="none"), backend=spec)
    result = Bisector(probe, valid=valid_config).run(start)
    assert {(c.knob, c.failing_value, c.passing_value) for c in result.necessary} == {("te", "2.18.0", "2.20.2")}
    record = BisectRecord(None, result.start, result.minimal, result.necessary, result.steps, {}, "", None, [], None)
    assert record.te_sentence() == "fails with TE 2.18.0, passes with 2.20.2: fixed by 2.20.2"
    assert _coords(knob_dict(result.minimal), select(["te.fused"])[0]).backend.name == "te.fused@te-2.18.0"
    everywhere = Bisector(lambda c: Outcome("FAIL", "dq: error 0.05", ("dq",)), valid=valid_config).run(start)
    assert all(c.knob != "te" for c in everywhere.necessary)
    record = BisectRecord(None, everywhere.start, everywhere.minimal, everywhere.necessary, everywhere.steps, {}, "",
                          None, [], None)
    assert record.te_sentence() == "reproduced with TE 2.18.0 and 2.20.2"
    knobs._te_releases.cache_clear()


def test_a_worker_on_a_prepared_release_does_not_speak_for_the_machine():
    from attn_doctor.execution.pool import Worker
    from attn_doctor.execution.session import Session

    on_release = Worker("te", "cuda", 1.0, {te_installs.SITE_VARIABLE: "/somewhere/2.18.0/site"})
    on_release.hello = {"family": "te", "pid": 1, "te_facts": {"te": "2.18.0"}}
    session = Session("cuda")
    session.workers = {"te with TE 2.18.0": [on_release]}
    assert session.facts == {}


def test_a_release_and_a_cudnn_build_together_keep_both_in_the_name():
    from attn_doctor.backends import BackendSpec, on_release, without_build

    spec = BackendSpec("te.fused@cudnn-9.19.0", "te", {"path": "fused", "cudnn": {"version": "9.19.0"}})
    both = on_release(spec, TEInstall("2.18.0", "/x/2.18.0"))
    assert both.name == "te.fused@te-2.18.0@cudnn-9.19.0" and both.options["cudnn"] == {"version": "9.19.0"}
    assert without_build(both.name) == "te.fused"
    assert on_release(both, TEInstall("2.20.2", "/x/2.20.2")).name == "te.fused@te-2.20.2@cudnn-9.19.0"


def test_the_environment_s_own_te_is_a_release_te_can_name_beside_the_prepared(home, monkeypatch, run_cli):
    """`--te 2.18.0,2.20.2` where 2.20.2 is the TE installed in the environment: its rows run in the plain TE worker
    (no folder put first), the read-back holds it to that version and to the environment's copy, a bisect from
    either side tries the other, and `te list` and the refusal name it."""
    from attn_doctor.backends import process_of, select
    from attn_doctor.bisect import knobs
    from attn_doctor.core.case import make_case

    _prepared(home, "2.18.0")
    monkeypatch.setattr(te_installs, "environment_install", lambda: TEInstall("2.20.2", ""))
    specs = select(["te.fused"], te="2.18.0,2.20.2", cudnn=None)
    assert [spec.name for spec in specs] == ["te.fused@te-2.18.0", "te.fused@te-2.20.2"]
    assert process_of(specs[1]) == ("te", {})  # the machine's own worker
    assert process_of(specs[0])[0] == "te with TE 2.18.0"
    with pytest.raises(BadInput, match=r"prepared: 2.18.0; installed: 2.20.2"):
        resolve("2.17.0", te_installs.choices())
    own = TEInstall("2.20.2", "")
    assert te_installs.release_not_honoured(own, "2.20.2", "/env/site-packages/transformer_engine/__init__.py") is None
    assert "imported TE 2.18.0" in te_installs.release_not_honoured(own, "2.18.0", "/env/transformer_engine/x.py")
    assert "imported TE 2.20.2" in te_installs.release_not_honoured(
        own, "2.20.2", str(home / "2.20.2" / "site" / "transformer_engine" / "__init__.py"))
    knobs._te_releases.cache_clear()
    case = make_case(batch=1, seq=4, heads=1, head_dim=8, dtype="fp32", mask="none")
    as_installed = knobs.coords_at(case, backend=select(["te.fused"])[0])
    assert [r.version for r in knobs._other_te_releases(as_installed)] == ["2.18.0"]
    on_old = knobs.coords_at(case, backend=specs[0])
    assert [(r.version, r.prepared) for r in knobs._other_te_releases(on_old)] == [("2.20.2", False)]
    knobs._te_releases.cache_clear()
    listed = run_cli(["te", "list"]).output
    assert "TE 2.20.2 (installed in this environment)" in listed and "TE 2.18.0 (built for torch" in listed
