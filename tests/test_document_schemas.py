"""Documents read back (issue 44): a field of the wrong type in a results file, a sweep's records or header, a
bisect document, a capture's header, call lines or model facts is bad input naming the file and the field (exit 2,
one line, no traceback), for every command that reads that document; what attn-doctor itself writes passes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import attn_doctor
from attn_doctor.core import schemas
from attn_doctor.core.errors import BadInput
from attn_doctor.tracing.store import read_capture
from tests.cli_checks import one_line_error
from tests.conftest import FAULTY, SMALL_FLAGS
from tests.models import tiny_gpt

KERNEL = f"bad={FAULTY}:dq_two_percent"
pytestmark = pytest.mark.slow  # the documents are made by real runs, a sweep, a bisect and a capture


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """One of each document, as attn-doctor writes them: a run's results, a sweep folder, a bisect folder and a
    capture with values (and model facts)."""
    from click.testing import CliRunner

    from attn_doctor.cli import cli

    root = tmp_path_factory.mktemp("documents")
    runner = CliRunner()
    small = [*SMALL_FLAGS, "--kernel", KERNEL]
    for args in (["run", *small, "--layout", "contiguous", "--json", root / "run" / "results.json"],
                 ["sweep", *small, "--seq", "32,64", "--layout", "contiguous", "--out", root / "sweep"],
                 ["bisect", "--from", root / "run" / "results.json", "--out", root / "bisect"]):
        result = runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code in (0, 1), result.output
    with attn_doctor.capture(root / "capture", values=True, layers=[1], steps=[0]):
        tiny_gpt.train(steps=1, layers=2)
    return {"run": root / "run", "sweep": root / "sweep", "bisect": root / "bisect", "capture": root / "capture"}


def _only(folder: Path, pattern: str) -> Path:
    (path,) = sorted(folder.glob(pattern))
    return path


def _edit_json(path: Path, change: Callable[[dict], None]) -> None:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def _edit_line(path: Path, pick: Callable[[dict], bool], change: Callable[[dict], None]) -> int:
    """Change the first line `pick` accepts; returns its line number."""
    lines = path.read_text().splitlines()
    number = next(i for i, line in enumerate(lines) if line.strip() and pick(json.loads(line)))
    document = json.loads(lines[number])
    change(document)
    lines[number] = json.dumps(document)
    path.write_text("\n".join(lines) + "\n")
    return number + 1


def _set(*path: str | int, to: object) -> Callable[[dict], None]:
    def change(document: dict) -> None:
        for part in path[:-1]:
            document = document[part]
        document[path[-1]] = to
    return change


def _drop(*path: str | int) -> Callable[[dict], None]:
    def change(document: dict) -> None:
        for part in path[:-1]:
            document = document[part]
        del document[path[-1]]
    return change


# Each damage: (what it breaks, the folder it needs, damage(folder) -> the words the error line must hold).

def _results_verdict(folder: Path) -> str:
    _edit_json(folder / "results.json", _set("results", 1, "verdict", to=1.5))
    return "results.json: field results[1].verdict is 1.5, not one of 'PASS'"


def _results_tensor(folder: Path) -> str:
    _edit_json(folder / "results.json", _set("results", 0, "tensors", "dq", to=[]))
    return "results.json: field results[0].tensors.dq is [], not an object"


def _results_layout_missing(folder: Path) -> str:
    _edit_json(folder / "results.json", _drop("results", 0, "layout"))
    return "results.json: field results[0].layout is missing"


def _results_seconds(folder: Path) -> str:
    _edit_json(folder / "results.json", _set("seconds", to=["a"]))
    return "results.json: field seconds is ['a'], not an object"


def _results_family(folder: Path) -> str:
    _edit_json(folder / "results.json", _set("results", 0, "family", to="x"))
    return "results[0]: family 'x' is no backend family"


def _results_kernel_options(folder: Path) -> str:
    _edit_json(folder / "results.json", _set("results", 1, "options", to={}))
    return "results[1]: a kernel row's options have no target or func"


def _sweep_record(folder: Path) -> str:
    (folder / "results.json").unlink()  # an interrupted sweep: its records are what report reads
    number = _edit_line(folder / "results.jsonl", lambda record: True, _set("detail", to=1.5))
    return f"results.jsonl:{number}: field detail is 1.5, not a string"


def _sweep_header(folder: Path) -> str:
    (folder / "results.json").unlink()
    _edit_json(folder / "sweep.json", _set("created", to=[2026]))
    return "sweep.json: field created is [2026], not a string"


def _bisect_probes(folder: Path) -> str:
    path = _only(folder, "bisect_*.json")
    _edit_json(path, _set("probes", to={}))
    return f"{path.name}: field probes is {{}}, not an array"


def _bisect_row(folder: Path) -> str:
    path = _only(folder, "bisect_*.json")
    _edit_json(path, _set("results", 0, "ran", to=["x"]))
    return f"{path.name}: field results[0].ran is ['x'], not a string"


def _capture_header(folder: Path) -> str:
    _edit_json(folder / "capture.json", _set("format_version", to="3"))
    return "capture.json: field format_version is '3', not an integer"


def _call_layer(folder: Path) -> str:
    path = _only(folder, "rank0/calls-*.jsonl")
    number = _edit_line(path, lambda line: "index" in line, _set("layer", to=[1]))
    return f"{path.name}:{number}: field layer is [1], not an integer or null"


def _call_shape(folder: Path) -> str:
    path = _only(folder, "rank0/calls-*.jsonl")
    number = _edit_line(path, lambda line: "tensors" in line, _set("tensors", "q", "shape", to=1.5))
    return f"{path.name}:{number}: field tensors.q.shape is 1.5, not an array"  # the signature's line holds it


def _gradient_geometry(folder: Path) -> str:
    path = _only(folder, "rank0/calls-*.jsonl")
    number = _edit_line(path, lambda line: "gradient_geometry" in line, _set("tensor", "shape", to="x"))
    return f"{path.name}:{number}: field tensor.shape is 'x', not an array"


def _model_checksums(folder: Path) -> str:
    path = _only(folder, "rank0/model-*.json")
    _edit_json(path, _set("weights", 0, "checksums", to="x"))
    return f"{path.name}: field weights[0].checksums is 'x', not an array"


def _model_data(folder: Path) -> str:
    path = _only(folder, "rank0/model-*.json")
    _edit_json(path, _set("data", to=[]))
    return f"{path.name}: field data is [], not"


def _replay_reference(capture: Path) -> str:
    call = next(c for c in read_capture(capture) if c.values_path is not None)
    return f"{capture}@{call.rank}.{call.meta['process']['pid']}.{call.index}"


RESULTS = [_results_verdict, _results_tensor, _results_layout_missing, _results_seconds, _results_family,
           _results_kernel_options]
CAPTURE = [_capture_header, _call_layer, _call_shape, _gradient_geometry]

# (command, the folder it reads, the damages it must refuse, its arguments given the damaged folder)
COMMANDS = [
    ("report", "run", RESULTS, lambda d: ["report", d / "results.json"]),
    ("report --format issue", "run", RESULTS, lambda d: ["report", d / "results.json", "--format", "issue"]),
    ("bisect --from", "run", RESULTS, lambda d: ["bisect", "--from", d / "results.json", "--out", d / "b"]),
    ("report sweep", "sweep", [_sweep_record, _sweep_header], lambda d: ["report", d]),
    ("report bisect", "bisect", [_bisect_probes, _bisect_row], lambda d: ["report", _only(d, "bisect_*.json")]),
    ("replay", "capture", CAPTURE, lambda d: ["replay", d, "--out", d / "replayed"]),
    ("compare", "capture", [*CAPTURE, _model_checksums, _model_data], lambda d: ["compare", d, d]),
    ("run --replay", "capture", CAPTURE, lambda d: ["run", "--device", "cpu", "--replay", _replay_reference(d)]),
]
CASES = [pytest.param(name, folder, damage, args, id=f"{name}-{damage.__name__.lstrip('_')}")
         for name, folder, damages, args in COMMANDS for damage in damages
         if not (name == "run --replay" and damage is _capture_header)]  # the reference is read before the header


@pytest.mark.parametrize("name, folder, damage, args", CASES)
def test_a_field_of_the_wrong_type_is_bad_input_naming_the_file_and_field(name, folder, damage, args, made,
                                                                          tmp_path, run_cli):
    copy = tmp_path / folder
    shutil.copytree(made[folder], copy)
    reference = args(copy) if name == "run --replay" else None  # read before the damage: it names a call
    words = damage(copy)
    result = run_cli(reference if reference is not None else args(copy))
    line = one_line_error(result)
    assert words in line, line


@pytest.mark.parametrize("folder", ["run", "sweep", "bisect"])
def test_what_attn_doctor_writes_fits_its_schemas(folder, made, run_cli):
    result = run_cli(["report", made[folder]])
    assert result.exit_code in (0, 1), result.output


def test_a_capture_as_written_fits_its_schemas(made):
    calls = read_capture(made["capture"])
    assert calls and all(c.meta["tensors"]["q"]["shape"] for c in calls)
    facts = json.loads(_only(made["capture"], "rank0/model-*.json").read_text())
    schemas.check(facts, schemas.MODEL_FACTS, "model.json", "")


@pytest.mark.parametrize("document, words", [
    ({"format": "attn-doctor/results", "results": "rows"}, "field results is 'rows', not an array"),
    ({"format": "attn-doctor/results"}, "field results is missing"),
    ([], "the document is [], not an object"),
    ({"format": "attn-doctor/results", "results": [], "command": "x" * 100}, None),
])
def test_check_names_the_field_and_passes_a_good_document(document, words):
    if words is None:
        schemas.check(document, schemas.RESULTS, "r.json", "fix")
        return
    with pytest.raises(BadInput, match="^r.json: ") as raised:
        schemas.check(document, schemas.RESULTS, "r.json", "fix it")
    assert words in str(raised.value) and str(raised.value).endswith("; fix it")
