"""Plumbing shared by every part, importing nothing above it: atomic files, runtime, the config error."""
