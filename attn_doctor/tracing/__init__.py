"""A user's own model: its attention calls recorded as they really happen (`record`, `attn-doctor capture`)
and kept on disk (`store`), for replay against float64 and for comparing two runs (issue 17's next steps)."""
