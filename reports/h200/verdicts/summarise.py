#!/usr/bin/env python3
"""Summarise the verdicts sweeps: per backend, PASS/FAIL/SKIP/ERROR counts, failing rows' why, max ratio of
passing rows, and the largest |bias_z| among PASS rows."""
import json, sys, collections, pathlib
for d in sys.argv[1:]:
    p = pathlib.Path(d)
    f = p / "results.json" if p.is_dir() else p
    if not f.exists():
        print(d, "missing"); continue
    doc = json.loads(f.read_text())
    rows = doc["results"]
    counts = collections.defaultdict(collections.Counter)
    worst = collections.defaultdict(float); zmax = collections.defaultdict(float); fails = []
    for r in rows:
        counts[r["backend"]][r["verdict"]] += 1
        for n, t in r.get("tensors", {}).items():
            if r["verdict"] == "PASS" and r["backend"] != "local":
                worst[r["backend"]] = max(worst[r["backend"]], t["ratio"])
                zmax[r["backend"]] = max(zmax[r["backend"]], abs(t.get("bias_z", 0)))
            if t["verdict"] == "FAIL":
                fails.append(f"  FAIL {r['backend']} {r['layout']} {r['case'].get('seq')} {n}: {t['why'][:150]}")
    print(f"== {d}: {len(rows)} rows; summary: {doc.get('summary','')[:300]}")
    for b, c in counts.items():
        print(f"  {b:16s} {dict(c)} max PASS ratio {worst.get(b,0):.2f} max |z| {zmax.get(b,0):.1f}")
    print("\n".join(fails[:15]))
