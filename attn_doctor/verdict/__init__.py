"""Verdicts: PASS or FAIL for one tensor and why (rule), rows judged against their baseline (judge), and
what a run concludes from its rows (diagnosis, depth)."""
