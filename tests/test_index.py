"""tests/README.md says where the tests of every module are: it names every module of the package and every
test file of this folder, and only those."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "attn_doctor"
TABLE = [line for line in (TESTS / "README.md").read_text().splitlines()
         if line.startswith("| ") and not line.startswith(("| module ", "| --- "))]


def _named(column: int) -> set[str]:
    return {name for line in TABLE for name in re.findall(r"`([^`]+)`", line.split(" | ")[column])}


def test_every_module_of_the_package_has_a_row():
    modules = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if path.name != "__init__.py"}
    assert modules - _named(0) == set(), "modules without a row in tests/README.md"
    assert _named(0) - modules == set(), "rows naming modules that do not exist"


def test_every_test_file_is_named_and_every_named_one_exists():
    files = {path.name for path in TESTS.glob("test_*.py")}
    named = {name for name in _named(1) if name.startswith("test_")}
    assert named - files == set(), "tests/README.md names test files that do not exist"
    assert files - named == set(), "test files tests/README.md does not name"
