"""attn-doctor: bisect and diagnose wrong attention gradients (TE, cuDNN, PyTorch SDPA) against float64."""

__version__ = "0.1.0"


def capture(directory, **options):
    """`with attn_doctor.capture("DIR"): ...` records every attention call made in the block
    (`attn_doctor.tracing.record.capture`: options values, layers, steps, ranks, max_bytes)."""
    from attn_doctor.tracing.record import capture as _capture

    return _capture(directory, **options)


def describe_parallel(**sizes):
    """Tell a capture this process's parallel layout, e.g. `describe_parallel(tp=2, tp_rank=1)`."""
    from attn_doctor.tracing.record import describe_parallel as _describe

    _describe(**sizes)
