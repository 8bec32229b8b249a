"""The order a sweep runs its points in (`probes.plan.in_build_order`): neighbours need different kernels built, so
that the workers, taking neighbouring points at once, do not build one kernel side by side; the same points, each
key's in grid order. What it buys is measured on a GPU (benchmarks/RESULTS.md), not here."""

from __future__ import annotations

import gzip
import json

from attn_doctor.core.case import expand_grid, make_case
from attn_doctor.core.recipes import load_recipe
from attn_doctor.probes.plan import in_build_order, kernel_key, plan_points


def _points(grid: dict) -> list:
    return plan_points(expand_grid({"batch": 1, "seq": 32, "heads": 2, "head_dim": 8}, grid), ["contiguous"])


def _second_builds(points: list, workers: int = 7) -> int:
    """Builds of a kernel key another point among the same `workers` neighbours builds first (not built before)."""
    built, again = set(), 0
    for start in range(0, len(points), workers):
        window = [kernel_key(p.case) for p in points[start:start + workers]]
        new = [key for key in window if key not in built]
        again += len(new) - len(set(new))
        built.update(window)
    return again


def test_neighbours_need_different_kernels_and_each_keys_points_keep_their_order():
    """Formats and batch sizes share a kernel, dtypes and masks do not: in grid order the formats of one kernel are
    neighbours; in build order one point of each kernel comes first, then the second of each."""
    points = _points({"dtype": ["bf16", "fp16"], "mask": ["no_mask", "causal"], "qkv_format": ["bshd", "sbhd"],
                      "batch": [1, 2]})
    ordered = in_build_order(points)
    assert sorted(p.id for p in ordered) == sorted(p.id for p in points)  # the same points, once each
    keys = [kernel_key(p.case) for p in ordered]
    assert len(set(keys[:4])) == 4 and keys[4:8] == keys[:4]  # one of each of the 4 kernels, then again
    for key in set(keys):
        assert [p for p in ordered if kernel_key(p.case) == key] == [p for p in points if kernel_key(p.case) == key]
    assert _second_builds(points, workers=4) > 0 and _second_builds(ordered, workers=4) == 0


def test_the_case_fields_a_kernel_is_built_for_are_in_its_key_and_the_sizes_and_layout_are_not():
    base = make_case(batch=1, seq=32, heads=2, head_dim=8)
    same = [make_case(batch=4, seq=32, heads=2, head_dim=8), make_case(batch=1, seq=64, heads=4, kv_heads=2,
                                                                       head_dim=8, qkv_format="bshd")]
    other = [make_case(batch=1, seq=32, heads=2, head_dim=8, dtype="fp16"),
             make_case(batch=1, seq=32, heads=2, head_dim=16),
             make_case(batch=1, seq=32, heads=2, head_dim=8, mask="no_mask"),
             make_case(batch=1, seq=32, heads=2, head_dim=8, window=(4, 0))]
    assert all(kernel_key(case) == kernel_key(base) for case in same)
    assert all(kernel_key(case) != kernel_key(base) for case in other)


def test_te_coverage_and_te_tests_build_no_kernel_twice_side_by_side_in_build_order():
    for name in ("te-coverage", "te-tests"):
        recipe = load_recipe(name)
        from attn_doctor.core.case import expand_grids

        cases, _ = expand_grids(recipe.case, [{**recipe.grid, **grid} for grid in recipe.grids] or [recipe.grid],
                                drop_invalid=recipe.drop_invalid)
        points = plan_points(cases, [])
        assert _second_builds(points) > 0, name  # grid order: neighbours share kernels
        assert _second_builds(in_build_order(points)) == 0, name


def test_a_sweep_runs_its_points_in_build_order(run_cli, tmp_path):
    out = tmp_path / "sweep"
    result = run_cli(["sweep", "--backend", "sdpa.math", "--device", "cpu", "--batch", "1", "--seq", "16", "--heads",
                      "2", "--head-dim", "8", "--dtype", "bf16,fp16", "--qkv-format", "bshd,sbhd", "--layout",
                      "contiguous", "--out", out])
    assert result.exit_code == 0, result.output
    stream = out / "results.jsonl"
    lines = (gzip.open(stream, "rt") if not stream.exists() else stream.open()).read().splitlines()
    dtypes = [row["case"]["dtype"] for row in map(json.loads, lines) if "backend" in row and
              row["backend"] == "sdpa.math"]
    assert dtypes[:2] in (["bf16", "fp16"], ["fp16", "bf16"])  # not both formats of one dtype first
