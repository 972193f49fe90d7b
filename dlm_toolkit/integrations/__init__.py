"""Bridges to other tools (imported on demand only: each needs its optional extra)."""
