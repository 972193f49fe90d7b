"""Plumbing shared by every part: atomic files, distributed helpers, runtime, provenance."""
