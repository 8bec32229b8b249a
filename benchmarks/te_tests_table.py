"""The te-tests recipe's results, family by family, as a Markdown table; and each FAIL of a TE path, with whether
TE's own cross-backend test would have passed it.

    python benchmarks/te_tests_table.py SWEEP_DIR [SWEEP_DIR ...] [--recipe te-tests] > table.md

Rows are counted per family of the recipe (`[[grids]] family = ...`; a case several families share counts in
each). TE's test (tests/pytorch/attention/test_attention.py) compares TE's backends pairwise with
torch.testing.assert_close (bf16 atol = rtol = 1.5e-2, fp16 1e-3), and skips when fewer than two run. From
attn-doctor's figures against float64 a FAIL is said to pass that test when:
- no other TE backend (te.flash, te.fused, te.unfused) ran the case: TE's test skips it;
- or, against some other TE backend R that ran it, every tensor's max|a - b| <= max|a - ref| + max|b - ref| is
  within atol: a sufficient condition (assert_close allows atol + rtol |b|), so "would pass" is proven, never
  guessed; where the bound exceeds atol the table says "not shown to pass", not "caught";
- FP8 cases: TE's FP8 test only logs a mismatch, and gates on RMSE <= 11-15 % of the value range
  (tests/pytorch/utils.py at v2.18: 239-265), which a FAIL here with rel. error below 0.7 likely meets (a Gaussian's
  range is about 7 RMS): an estimate, not a bound, and the row says "likely".
Each FAIL also names the known-defect rule (attn_doctor/data/known_bugs.toml) that matches it on the sweep's
machine, as `attn-doctor report` would, or "none": the FAILs still to bisect.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attn_doctor.core.case import Case, expand_grids  # noqa: E402
from attn_doctor.core.recipes import load_recipe  # noqa: E402

TE_BACKENDS = ("te.flash", "te.fused", "te.unfused")
TE_ATOL = {"bf16": 1.5e-2, "fp16": 1e-3, "fp32": 1e-4}
FP8_GATE_REL = 0.7


def read_rows(directory: Path) -> list[dict]:
    """A sweep folder's rows: results.json, else its stream (results.jsonl, or gzipped)."""
    if (directory / "results.json").is_file():
        return json.loads((directory / "results.json").read_text())["results"]
    for name, opener in (("results.jsonl", open), ("results.jsonl.gz", gzip.open)):
        if (directory / name).is_file():
            with opener(directory / name, "rt") as lines:
                return [json.loads(line) for line in lines if '"backend"' in line]
    raise SystemExit(f"{directory}: no results.json, results.jsonl or results.jsonl.gz")


def known_rules(directory: Path) -> dict[tuple, str]:
    """(case key, backend, layout) of each FAIL or ERROR row -> the id of the known-defect rule whose symptom it
    shows on the sweep's machine (sweep.json's environment), "" where none does."""
    import shutil
    import tempfile

    from attn_doctor.known_defects import find_known_bugs, load_known_bugs, row_probe
    from attn_doctor.results.log import load_results

    with tempfile.TemporaryDirectory() as unpacked:
        source = directory
        if not (directory / "results.json").is_file() and not (directory / "results.jsonl").is_file():
            source = Path(unpacked)  # a committed stream is gzipped; the loader reads it plain
            with gzip.open(directory / "results.jsonl.gz", "rb") as packed, open(source / "results.jsonl", "wb") as out:
                shutil.copyfileobj(packed, out)
            if (directory / "sweep.json").is_file():
                shutil.copy(directory / "sweep.json", source / "sweep.json")
        report, _ = load_results(source)
    fails = [row for row in report.rows if row.verdict in ("FAIL", "ERROR")]
    probes = [row_probe(row, report.env) for row in fails] if report.env is not None else []
    shown = {id(probe): finding.bug.id for finding in find_known_bugs(load_known_bugs(), report.env, probes)
             for probe in finding.shown} if probes else {}
    return {(row.case.key(), row.backend, row.layout): shown.get(id(probe), "") for row, probe in zip(fails, probes)}


def family_keys(recipe_name: str) -> dict[str, set[tuple]]:
    recipe = load_recipe(recipe_name)
    keys = {}
    for family in recipe.family_names():
        cases, _ = expand_grids(recipe.case, [{**recipe.grid, **g} for g in recipe.grids_of([family])],
                                drop_invalid=recipe.drop_invalid)
        keys[family] = {case.key() for case in cases}
    return keys


def te_test_would_pass(row: dict, same_case: list[dict]) -> str:
    case = row["case"]
    if case.get("fp8", "none") != "none":
        worst = max((t["rel_err"] for t in row["tensors"].values()), default=0.0)
        if worst < FP8_GATE_REL:
            return (f"likely (an estimate): TE's FP8 test only logs a mismatch and gates on RMSE <= 11-15 % of the "
                    f"range; worst rel. error {worst:.2g}")
    others = [r for r in same_case if r["backend"] in TE_BACKENDS and r["backend"] != row["backend"].split("@")[0]
              and r.get("tensors")]
    if not others:
        return "yes: TE's test skips it (no other TE backend runs this case)"
    atol = TE_ATOL.get(case.get("dtype", "bf16"), 1.5e-2)
    for other in others:
        shared = set(row["tensors"]) & set(other["tensors"])
        bound = max((row["tensors"][n]["max_abs_err"] + other["tensors"][n]["max_abs_err"] for n in shared),
                    default=float("inf"))
        if shared and bound <= atol:
            return f"yes: within TE's atol {atol:g} of {other['backend']} (max|a-b| <= {bound:.2g})"
    also = [o["backend"] for o in others if o["verdict"] == "FAIL"]
    return "not shown to pass" + (f" ({', '.join(also)} fails too)" if also else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directories", nargs="+", type=Path)
    parser.add_argument("--recipe", default="te-tests")
    args = parser.parse_args(argv)
    rows = [row for directory in args.directories for row in read_rows(directory)]
    by_case: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        row["_key"] = Case.from_dict(row["case"]).key()
        by_case[(row["_key"], row.get("layout"))].append(row)
    families = family_keys(args.recipe)
    rules = {key: rule for directory in args.directories for key, rule in known_rules(directory).items()}
    print("| family | cases | rows | PASS | FAIL | ERROR | INCONCLUSIVE | SKIP | TOO-BIG |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    skips: dict[str, Counter] = {}
    for family, keys in families.items():
        mine = [row for row in rows if row["_key"] in keys]
        counts = Counter(row["verdict"] for row in mine)
        ran_cases = len({row["_key"] for row in mine})
        print(f"| {family} | {ran_cases} of {len(keys)} | {len(mine)} | " + " | ".join(
            str(counts.get(v, 0)) for v in ("PASS", "FAIL", "ERROR", "INCONCLUSIVE", "SKIP", "TOO-BIG")) + " |")
        skips[family] = Counter(f"{row['backend']}: {row['reason'][:150]}" for row in mine if row["verdict"] == "SKIP")
    total = Counter(row["verdict"] for row in rows)
    print(f"| **all** | {len({row['_key'] for row in rows})} | {len(rows)} | " + " | ".join(
        str(total.get(v, 0)) for v in ("PASS", "FAIL", "ERROR", "INCONCLUSIVE", "SKIP", "TOO-BIG")) + " |")
    print("\n## SKIP reasons per family (row counts)\n")
    for family, reasons in skips.items():
        if reasons:
            print(f"- **{family}**: " + "; ".join(f"{n}× {reason}" for reason, n in reasons.most_common(6)))
    print("\n## Every FAIL and ERROR of a TE path: the known defect it matches, and whether TE's own test would pass it\n")
    print("| family | path | layout | case | failing | known defect | TE's test passes it? |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        if row["verdict"] not in ("FAIL", "ERROR") or not row["backend"].startswith("te."):
            continue
        family = ",".join(f for f, keys in families.items() if row["_key"] in keys)
        case = Case.from_dict(row["case"]).short()
        failing = ", ".join(n for n, t in (row.get("tensors") or {}).items() if t["verdict"] == "FAIL") or (
            row.get("reason", "")[:80])
        verdict = te_test_would_pass(row, by_case[(row["_key"], row.get("layout"))]) if row["verdict"] == "FAIL" \
            else "n/a (ERROR)"
        rule = rules.get((row["_key"], row["backend"], row.get("layout", ""))) or "none"
        print(f"| {family} | {row['backend']} | {row.get('layout', '')} | {case} | {failing} | {rule} | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
