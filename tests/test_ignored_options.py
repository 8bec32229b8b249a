"""An option that would be ignored is bad input (issue 44): exit 2, one line on stderr naming the option and
what to do, nothing run. The same options where they do apply are accepted."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import SMALL_FLAGS

IGNORED = [  # (arguments, the option the line must name, words it must say)
    (["run", *SMALL_FLAGS, "--cp-comm-type", "a2a"], "--cp-comm-type", "--cp"),
    (["sweep", *SMALL_FLAGS, "--layers", "1,2", "--workers", "2"], "--workers", "one worker"),
    (["bisect", *SMALL_FLAGS, "--backend", "sdpa.math", "--row", "1"], "--row", "--from"),
    (["capture", "--out", "{tmp}/cap", "--max-bytes", "1MB", "--", sys.executable, "-c", "pass"], "--max-bytes",
     "--values"),
    (["capture", "--out", "{tmp}/cap", "--values", "--max-bytes", "0", "--", sys.executable, "-c", "pass"],
     "--max-bytes", "above 0"),
]


@pytest.mark.parametrize("arguments, option, words", IGNORED, ids=[" ".join(a[:1] + [o]) for a, o, _ in IGNORED])
def test_an_option_that_would_be_ignored_is_refused(run_cli, tmp_path, arguments, option, words):
    result = run_cli([a.format(tmp=tmp_path) for a in arguments])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in result.output
    assert option in line and words in line, line
    assert not (tmp_path / "cap").exists()  # nothing ran


def test_the_same_options_where_they_apply_are_accepted(run_cli, tmp_path):
    attention = "import torch; torch.nn.functional.scaled_dot_product_attention(*[torch.ones(1, 1, 2, 4)] * 3)"
    result = run_cli(["capture", "--out", tmp_path / "cap", "--values", "--max-bytes", "1MB", "--", sys.executable,
                      "-c", attention])
    assert result.exit_code == 0, result.output
