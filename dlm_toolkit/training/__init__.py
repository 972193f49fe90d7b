"""Training: the loop, its config, objective, claims and resume.

Re-exports the public names of ``loop.py`` (the module this package replaced)."""

from dlm_toolkit.training import loop as _base
from dlm_toolkit.training.loop import *  # noqa: F401,F403 -- its __all__

__all__ = list(_base.__all__)
