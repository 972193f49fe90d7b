"""The toolkit's configuration error, in the bottom layer so that every layer can raise it.

:class:`ConfigError` lives here, not in ``dlm_toolkit.config``, because ``util`` sits below
``config`` (``config`` reads files through ``util.files``) and ``util`` raises it too (a bad
device, dtype or torchrun variable). ``dlm_toolkit.config`` re-exports it: ``from
dlm_toolkit.config import ConfigError`` names this very class.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """An invalid configuration; the message names the field path, the value and what is allowed."""
