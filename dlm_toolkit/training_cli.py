"""Training command (being written)."""


def register(sub) -> None:
    pass
