"""The folder `attn-doctor capture` puts first on PYTHONPATH (its sitecustomize starts the capture)."""
