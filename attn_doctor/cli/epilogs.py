"""What each command's --help ends with: one or two examples a new user can copy, and the command's exit codes.
One home for both: tests/test_help.py parses every example against its command's options."""

from __future__ import annotations

JUDGING = ("0 every tested path passes; 1 a path FAILs or ERRORs, or could not be judged; 2 bad input, or a "
           "request that cannot run here (nothing is run); 130 Ctrl-C and 143 SIGTERM (what finished is kept).")

EXIT_CODES = {
    "env": "0 the fingerprint was printed; 2 bad input.",
    "run": JUDGING,
    "sweep": JUDGING,
    "replay": JUDGING,
    "bisect": ("0 bisected (the repro and the bisect document written); 1 the start does not fail, or the bisect "
               "cannot go on; 2 bad input; 130 Ctrl-C."),
    "report": "0 written; 2 bad input (a file or folder that cannot be read, an output that cannot be written).",
    "capture": ("0 the command ran and its attention calls were recorded; 1 the command itself failed (its exit code "
                "is printed); 2 bad input, or no attention call was recorded; 130 Ctrl-C."),
    "compare": ("0 the same run within rounding; 1 the runs differ upstream (weights, data, dropout, settings), or "
                "one run's attention is far from float64 where the other's is not; 2 bad input."),
    "te": ("0 prepared (or already) / listed; 2 bad input, or an install that pip or the import check refused "
           "(its last error line; nothing is left behind)."),
}

EXAMPLES = {
    "env": ["attn-doctor env", "attn-doctor env --json > env.json"],
    "run": ["attn-doctor run", "attn-doctor run --backend te --seq 4096 --dtype fp16 --max-memory 24GiB"],
    "sweep": ["attn-doctor sweep --layers 24,128", "attn-doctor sweep --recipe te-coverage --out cov"],
    "replay": ["attn-doctor replay tp1", "attn-doctor replay tp1 --layer 23 --backend te"],
    "bisect": ["attn-doctor bisect --from attn-doctor-results/run-STAMP/results.json",
               "attn-doctor bisect --backend te.fused --layout transposed"],
    "report": ["attn-doctor report attn-doctor-results/run-STAMP/results.json --format issue",
               "attn-doctor report cov/shard-* --output coverage.md"],
    "capture": ["attn-doctor capture --out tp1 --values --layers 0,23 --steps 1 -- python train.py",
                "attn-doctor capture --out tp2 --values -- torchrun --nproc-per-node 2 train.py --tp 2"],
    "compare": ["attn-doctor compare tp1 tp2", "attn-doctor compare tp1 tp2 --json tp1-vs-tp2.json"],
    "te": ["attn-doctor te add 2.18.0", "attn-doctor te add 2.18.0 --from ./te-2.18.0-wheels"],
}


def epilog(command: str) -> str:
    """The end of `command`'s --help. click rewraps paragraphs; the `\\b` line keeps each example on its own line."""
    examples = "\n".join(f"  {example}" for example in EXAMPLES[command])
    return f"\b\nExamples:\n{examples}\n\nExit codes: {EXIT_CODES[command]}"
