"""Evaluation: evaluate/generate over tasks, conformance, statistics and plots."""
