"""Sweep commands (being written)."""


def register(sub) -> None:
    pass
