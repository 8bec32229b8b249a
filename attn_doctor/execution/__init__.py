"""Running probes: worker processes, the session that schedules probes over them, the float64 reference
they share, the memory budget checked before anything starts, and progress events."""
