"""Where a library's import goes, and how much of it is compiling Python sources (issue 51: TE's import in its fork
server is a cold sweep's critical path, and the GPU image ships torch without bytecode and sets
PYTHONDONTWRITEBYTECODE=1, so every process compiles what it imports).

    python3 benchmarks/import_cost.py OUT [--module transformer_engine.pytorch] [--jobs 16]

Each import runs in a fresh interpreter (`-X importtime`), timed for wall, CPU and pages read from disk:
  as-is          the environment as it is (drop the page cache first for a cold figure), twice
  exact-list     the .py files that import loaded, compiled on --jobs processes into a private bytecode prefix (the
                 compile's wall time), then the import with that prefix
  directories    every file under the packages that import touched and the standard library, compiled the same way
                 (what a tool could do without knowing the list), then the import with that prefix
Writes OUT/import-cost.json, OUT/import-cost.txt (the table) and OUT/importtime-LABEL.txt (-X importtime's log).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import py_compile
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

_LIST_LOADED = """
import json, sys, importlib.util, os
import {module}
files = []
for name, module in list(sys.modules.items()):
    origin = getattr(getattr(module, '__spec__', None), 'origin', None)
    if origin and origin.endswith('.py'):
        files.append(origin)
json.dump(sorted(set(files)), open({path!r}, 'w'))
"""


def _timed_import(module: str, label: str, out: Path, prefix: str | None = None, list_to: Path | None = None) -> dict:
    environment = dict(os.environ)
    if prefix is not None:
        environment["PYTHONPYCACHEPREFIX"] = prefix
    code = _LIST_LOADED.format(module=module, path=str(list_to)) if list_to else f"import {module}"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(out / f"importtime-{label}.txt", "w") as log:
        completed = subprocess.run([sys.executable, "-X", "importtime", "-c", code], stderr=log, env=environment)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"label": label, "rc": completed.returncode, "wall_s": round(wall, 2),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
            "major_faults": after.ru_majflt - before.ru_majflt,
            "slowest_self": _slowest(out / f"importtime-{label}.txt")}


def _slowest(log: Path, count: int = 12) -> list[tuple[str, float]]:
    """-X importtime's modules with the most time of their own (seconds)."""
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        parts = line.split("|")
        try:
            rows.append((parts[2].strip(), int(parts[0].split(":")[1]) / 1e6))
        except (IndexError, ValueError):
            continue
    return sorted(rows, key=lambda row: -row[1])[:count]


def _compile_one(arguments: tuple[str, str]) -> bool:
    path, prefix = arguments
    sys.pycache_prefix = prefix  # cache_from_source reads it: the bytecode lands in the prefix, never beside the source
    try:
        return py_compile.compile(path, doraise=True) is not None
    except Exception:
        return False


def _compile(files: list[str], prefix: str, jobs: int) -> dict:
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        compiled = sum(pool.map(_compile_one, [(path, prefix) for path in files], chunksize=32))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"files": len(files), "compiled": compiled, "wall_s": round(time.perf_counter() - start, 2),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2)}


def _package_roots(files: list[str]) -> list[Path]:
    """The top-level package folders of the loaded files (site-packages' and the standard library's)."""
    bases = sorted({sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib")}, key=len, reverse=True)
    roots: set[Path] = set()
    for name in files:
        for base in bases:
            if name.startswith(base + os.sep):
                top = Path(name[len(base) + 1:]).parts[0]
                roots.add(Path(base) / top)
                break
    return sorted(roots)


def _sources_under(roots: list[Path]) -> list[str]:
    skip = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
            "dist-packages", "__pycache__"}
    found = []
    for root in roots:
        if root.is_file():
            found.append(str(root))
            continue
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [name for name in subfolders if name not in skip]
            found.extend(os.path.join(folder, name) for name in names if name.endswith(".py"))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--module", default="transformer_engine.pytorch")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    listed = args.out / "loaded.json"
    results = {"module": args.module, "jobs": args.jobs, "python": sys.version.split()[0],
               "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"), "imports": [], "compiles": {}}
    results["imports"].append(_timed_import(args.module, "as-is-first", args.out, list_to=listed))
    results["imports"].append(_timed_import(args.module, "as-is-again", args.out))
    files = json.loads(listed.read_text())
    results["loaded_sources"] = len(files)
    results["with_bytecode_beside"] = sum(
        os.path.exists(os.path.join(os.path.dirname(f), "__pycache__",
                                    f"{Path(f).stem}.{sys.implementation.cache_tag}.pyc")) for f in files)
    with tempfile.TemporaryDirectory() as exact, tempfile.TemporaryDirectory() as whole:
        results["compiles"]["exact-list"] = _compile(files, exact, args.jobs)
        results["imports"].append(_timed_import(args.module, "exact-list", args.out, prefix=exact))
        roots = _package_roots(files)
        results["roots"] = [str(root) for root in roots]
        results["compiles"]["directories"] = _compile(_sources_under(roots), whole, args.jobs)
        results["imports"].append(_timed_import(args.module, "directories", args.out, prefix=whole))
    (args.out / "import-cost.json").write_text(json.dumps(results, indent=1))
    lines = [f"import {args.module}: {results['loaded_sources']} sources loaded, "
             f"{results['with_bytecode_beside']} with bytecode beside them; Python {results['python']}, "
             f"PYTHONDONTWRITEBYTECODE={results['PYTHONDONTWRITEBYTECODE']}, {args.jobs} compile processes"]
    for name, figures in results["compiles"].items():
        lines.append(f"compile {name}: {figures['compiled']}/{figures['files']} files, {figures['wall_s']} s wall, "
                     f"{figures['cpu_s']} s CPU")
    for row in results["imports"]:
        lines.append(f"import {row['label']}: {row['wall_s']} s wall, {row['cpu_s']} s CPU, "
                     f"{row['major_faults']} major faults, rc {row['rc']}")
        lines.extend(f"    {seconds:6.3f} s  {name}" for name, seconds in row["slowest_self"][:8])
    (args.out / "import-cost.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
