"""Shared fixtures: a small case that runs in milliseconds, the test kernels, and a CliRunner helper."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from attn_doctor.core.case import make_case

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
FAULTY = KERNELS_DIR / "faulty.py"
BROKEN = KERNELS_DIR / "broken.py"

# The CLI flags of `small_case`: every `run` in the tests uses them (or smaller), so a probe takes milliseconds.
SMALL_FLAGS = ["--batch", "2", "--seq", "64", "--heads", "4", "--head-dim", "16", "--device", "cpu"]


@pytest.fixture(scope="session")
def small_case():
    """b2 s64 h4 d16 bf16 causal: the default case's kind, shrunk."""
    return make_case(batch=2, seq=64, heads=4, head_dim=16, dtype="bf16", mask="causal", seed=0)


@pytest.fixture(scope="session")
def faulty_path() -> Path:
    return FAULTY


@pytest.fixture(scope="session")
def broken_path() -> Path:
    return BROKEN


@pytest.fixture(scope="session")
def small_flags() -> list[str]:
    return list(SMALL_FLAGS)


@pytest.fixture(scope="session")
def cli_runner() -> CliRunner:
    # A wide, colourless terminal: rich then prints whole cells instead of truncating them with an ellipsis.
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


@pytest.fixture(scope="session")
def run_cli(cli_runner):
    """run_cli(args) -> click Result of `attn-doctor ARGS` (in-process; worker processes are real).

    Exceptions other than SystemExit propagate, so a crash of the CLI itself fails the test loudly.
    """
    from attn_doctor.cli import cli

    def invoke(args):
        return cli_runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)

    return invoke
