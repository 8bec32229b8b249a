"""Paths the user gives (issue 44): every output path (--json, --out, --output, --merge-to, capture's --out) and
every input path (report's, replay's and compare's folders, --from, --resume, --recipe, --kernel, --replay) is
checked once, up front: a name too long for the file system, a path under an existing file or a folder that cannot
be made is exit 2 with one line naming the option and why, and nothing runs. An existing device node, FIFO or
symbolic link given as an output is written to, never replaced by a regular file."""

from __future__ import annotations

import os
import stat
import sys
import threading
from pathlib import Path

import pytest

from tests.cli_checks import one_line_error
from tests.conftest import FAULTY, SMALL_FLAGS

LONG = "x" * 300  # longer than any file system's name limit (255 bytes)
SMALL = [*SMALL_FLAGS, "--backend", "local", "--layout", "contiguous"]

# (the option, whether it names a folder, the command line around it: {} is the path)
OUTPUTS = [
    ("--json", False, ["run", *SMALL, "--json", "{}"]),
    ("--out", True, ["sweep", *SMALL, "--out", "{}"]),
    ("--out", True, ["bisect", "--backend", "local", "--device", "cpu", "--out", "{}"]),
    ("--json", False, ["bisect", "--backend", "local", "--device", "cpu", "--json", "{}"]),
    ("--output", False, ["report", "results.json", "--output", "{}"]),
    ("--merge-to", True, ["report", "a", "b", "--merge-to", "{}"]),
    ("--out", True, ["capture", "--out", "{}", "--", sys.executable, "-c", "pass"]),
    ("--out", True, ["replay", "capture", "--out", "{}"]),
    ("--json", False, ["compare", "a", "b", "--json", "{}"]),
]
INPUTS = [
    ("RESULTS", ["report", "{}"]),
    ("CAPTURE_DIR", ["replay", "{}"]),
    ("CAPTURE_A", ["compare", "{}", "b"]),
    ("--from", ["bisect", "--from", "{}"]),
    ("--resume", ["sweep", *SMALL, "--resume", "{}"]),
    ("--recipe", ["run", *SMALL, "--recipe", "{}"]),
    ("--kernel", ["run", *SMALL, "--kernel", "{}:attention"]),
    ("--replay", ["run", *SMALL, "--replay", "{}@0.1.2"]),
]


def _bad_paths(tmp_path: Path, folder: bool, suffix: str) -> list[tuple[str, str, str]]:
    """(name, path, the system's reason) of paths nothing can be written to or read from."""
    (tmp_path / "afile").write_text("a file, not a folder")
    return [("too-long", str(tmp_path / f"{LONG}{suffix}"), "File name too long"),
            ("under-a-file", str(tmp_path / "afile" / f"x{suffix}"), "not a folder" if folder else "Not a directory"),
            ("proc", f"/proc/attn-doctor-no-such-folder/x{suffix}", "No such file or directory")]


def _filled(args: list[str], path: str) -> list[str]:
    return [part.replace("{}", path) for part in args]


@pytest.mark.parametrize("bad", ["too-long", "under-a-file", "proc"])
@pytest.mark.parametrize("option, folder, args", OUTPUTS, ids=[f"{a[0]}-{o}" for o, _, a in OUTPUTS])
def test_an_output_path_that_cannot_be_written_is_refused_before_anything_runs(option, folder, args, bad, tmp_path,
                                                                              run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name, path, reason = next(p for p in _bad_paths(tmp_path, folder, "" if folder else ".json") if p[0] == bad)
    if bad == "under-a-file" and not folder:
        reason = "afile is not a folder"
    line = one_line_error(run_cli(_filled(args, path)))
    assert f"cannot write {option} " in line and reason in line, line
    assert not (tmp_path / "attn-doctor-results").exists()  # nothing ran
    assert len(line) < 250  # a long name is shown cut


@pytest.mark.parametrize("bad", ["too-long", "under-a-file"])
@pytest.mark.parametrize("option, args", INPUTS, ids=[o for o, _ in INPUTS])
def test_an_input_path_that_cannot_be_read_is_refused(option, args, bad, tmp_path, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    suffix = {"--recipe": ".toml", "--kernel": ".py"}.get(option, "")
    name, path, reason = next(p for p in _bad_paths(tmp_path, False, suffix) if p[0] == bad)
    line = one_line_error(run_cli(_filled(args, path)))
    assert f"cannot read {option} " in line and reason in line, line
    assert not (tmp_path / "attn-doctor-results").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file whatever its mode")
def test_an_unreadable_results_file_is_refused(tmp_path, run_cli):
    path = tmp_path / "results.json"
    path.write_text("{}")
    path.chmod(0)
    line = one_line_error(run_cli(["report", path]))
    assert "cannot read RESULTS" in line and "Permission denied" in line


@pytest.mark.slow
def test_a_symbolic_link_given_as_output_stays_a_link_to_what_is_written(tmp_path, run_cli):
    target, link = tmp_path / "kept" / "results.json", tmp_path / "link.json"
    target.parent.mkdir()
    link.symlink_to(target)
    result = run_cli(["run", *SMALL, "--kernel", f"bad={FAULTY}:dq_two_percent", "--json", link])
    assert result.exit_code == 1, result.output
    assert link.is_symlink() and '"attn-doctor/results"' in target.read_text()


@pytest.mark.slow
def test_a_fifo_given_as_output_is_written_to_not_replaced(tmp_path, run_cli):
    results = tmp_path / "results.json"
    assert run_cli(["run", *SMALL, "--json", results]).exit_code == 0
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    read: list[bytes] = []
    reader = threading.Thread(target=lambda: read.append(fifo.read_bytes()))
    reader.start()
    result = run_cli(["report", results, "--output", fifo])
    reader.join(timeout=30)
    assert result.exit_code == 0, result.output
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still the FIFO
    assert b"local" in read[0]


@pytest.mark.slow
def test_a_link_to_standard_output_gets_the_document(tmp_path):
    """`--json /dev/stdout` in a pipe: the link leads to the pipe, which is written to (resolving the link by name
    would give /proc/self/fd/pipe:[N], a file that does not exist; renaming onto it would replace the link). The
    link is one of the test's own, to /proc/self/fd/1 as /dev/stdout is: a regression must not replace the
    machine's /dev/stdout (as root, it would)."""
    import subprocess

    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")
    done = subprocess.run([sys.executable, "-m", "attn_doctor", "run", *SMALL, "--json", str(link)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert '"format": "attn-doctor/results"' in done.stdout and "kept in" not in done.stderr
    assert link.is_symlink()
