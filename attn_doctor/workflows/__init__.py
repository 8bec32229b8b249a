"""The work behind `run` and `sweep`, as functions the command line calls and tests call without it."""
