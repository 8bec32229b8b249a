"""A sweep past one machine (issue 35): `sweep --shard I/N` runs a deterministic slice of the grid's points, and
`report DIR1 DIR2 ...` merges the slices (one report per machine), `--merge-to` into one sweep folder that
`sweep --resume` continues. Real sweeps on the CPU, on a grid of tiny cases."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from attn_doctor.core.case import make_case
from attn_doctor.probes.plan import plan_points, shard_of
from attn_doctor.results.log import RESULTS_FILE
from cli_checks import one_line_error

GRID = ["--backend", "sdpa.math", "--batch", "1,2", "--seq", "4,8,16", "--heads", "1", "--head-dim", "8",
        "--dtype", "fp32", "--mask", "causal", "--layout", "contiguous", "--device", "cpu"]


def test_the_shards_are_disjoint_cover_every_point_and_do_not_depend_on_the_grids_order():
    cases = [make_case(batch=b, seq=s, heads=1, head_dim=8) for b in (1, 2, 3) for s in (4, 8, 16, 32, 64)]
    points = plan_points(cases, ["contiguous"])
    for count in (1, 2, 4, 7, 15, 20):
        shards = [shard_of(points, index, count) for index in range(1, count + 1)]
        ids = [p.id for shard in shards for p in shard]
        assert sorted(ids) == sorted(p.id for p in points) and len(ids) == len(set(ids))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
        shuffled = random.Random(count).sample(points, len(points))
        assert [shard_of(shuffled, i, count) for i in range(1, count + 1)] == shards


def _points(folder: Path) -> list[str]:
    lines = [json.loads(line) for line in (folder / RESULTS_FILE).read_text().splitlines()]
    return [line["point"] for line in lines if line.get("point_complete")]


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory, run_cli) -> dict[str, Path]:
    """The grid unsharded, and in three shards."""
    root = tmp_path_factory.mktemp("shards")
    folders = {"all": root / "all", **{f"{i}/3": root / f"shard{i}" for i in (1, 2, 3)}}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        for name, folder in folders.items():
            shard = [] if name == "all" else ["--shard", name]
            result = run_cli(["sweep", *GRID, *shard, "--out", folder])
            assert result.exit_code == 0, result.output
    return folders


@pytest.mark.slow
def test_the_shards_union_is_the_unsharded_sweep_with_no_point_twice(sweeps):
    whole = _points(sweeps["all"])
    parts = [_points(sweeps[f"{i}/3"]) for i in (1, 2, 3)]
    assert len(whole) == 6 and all(len(part) == 2 for part in parts)
    together = [point for part in parts for point in part]
    assert sorted(together) == sorted(whole) and len(set(together)) == len(together)


@pytest.mark.slow
def test_report_merges_the_shards_into_the_unsharded_report(sweeps, run_cli):
    merged = run_cli(["report", *(sweeps[f"{i}/3"] for i in (1, 2, 3)), "--format", "json"])
    whole = run_cli(["report", sweeps["all"], "--format", "json"])
    assert merged.exit_code == whole.exit_code == 0, merged.output
    merged_doc, whole_doc = json.loads(merged.output), json.loads(whole.output)

    def rows(doc: dict) -> list[tuple]:
        return sorted((r["backend"], json.dumps(r["case"], sort_keys=True), r["layout"], r["verdict"])
                      for r in doc["results"])

    assert rows(merged_doc) == rows(whole_doc) and len(merged_doc["results"]) == 12  # local + sdpa.math, 6 cases
    assert merged_doc["summary"] == whole_doc["summary"]
    markdown = run_cli(["report", *(sweeps[f"{i}/3"] for i in (1, 2, 3))])
    assert "Machine 1 of" not in markdown.output  # one machine: one report


@pytest.mark.slow
def test_merged_shards_resume_as_one_sweep_running_only_what_none_finished(sweeps, run_cli, tmp_path):
    merged = tmp_path / "merged"
    result = run_cli(["report", sweeps["1/3"], sweeps["3/3"], "--merge-to", merged, "--format", "json"])
    assert result.exit_code == 0, result.output
    assert len(_points(merged)) == 4
    resumed = run_cli(["sweep", *GRID, "--resume", merged])
    assert resumed.exit_code == 0, resumed.output
    assert "resuming" in resumed.output and "4 of 6 points already done" in resumed.output
    assert sorted(_points(merged)) == sorted(_points(sweeps["all"]))  # the middle shard's points, run now
    # a shard resumed as another shard is refused: its points are not that slice's
    line = one_line_error(run_cli(["sweep", *GRID, "--shard", "2/3", "--resume", sweeps["1/3"]]))
    assert "not in this command's grid" in line


@pytest.mark.slow
def test_results_of_two_machines_are_two_reports_and_one_folder_refuses_them(sweeps, run_cli, tmp_path):
    other = tmp_path / "other-machine"
    shutil.copytree(sweeps["2/3"], other)
    for name in ("sweep.json", "results.json"):
        document = json.loads((other / name).read_text())
        document["env"]["torch"] = {"value": "2.99.0", "note": None}
        (other / name).write_text(json.dumps(document))
    markdown = run_cli(["report", sweeps["1/3"], other])
    assert markdown.exit_code == 0, markdown.output
    assert "# Machine 1 of 2:" in markdown.output and "# Machine 2 of 2:" in markdown.output
    assert "torch 2.99.0" in markdown.output
    csv = run_cli(["report", sweeps["1/3"], other, "--format", "csv"]).output.splitlines()
    assert csv[0].startswith("machine,backend") and any("torch 2.99.0" in line for line in csv[1:])
    assert "one machine's" in one_line_error(run_cli(["report", sweeps["1/3"], other, "--format", "issue"]))
    assert "different machines" in one_line_error(run_cli(["report", sweeps["1/3"], other, "--merge-to",
                                                           tmp_path / "m"]))
