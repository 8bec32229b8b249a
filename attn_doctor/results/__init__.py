"""Results: one judged row, the document of a run with everything derived from its rows, atomic writes,
and a sweep's streamed rows."""
