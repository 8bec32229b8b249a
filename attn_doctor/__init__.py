"""attn-doctor: bisect and diagnose wrong attention gradients (TE, cuDNN, PyTorch SDPA) against float64."""

__version__ = "0.1.0"
