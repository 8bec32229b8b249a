"""Rendering, and nothing else: terminal tables, markdown, html, csv, the depth plot, progress on a terminal."""
