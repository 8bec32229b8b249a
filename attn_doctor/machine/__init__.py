"""Facts about the machine: its fingerprint, what TE loaded, the devices, and the known TE/cuDNN defects
that match it."""
