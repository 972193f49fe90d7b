"""The ``dlm`` subcommands, one module each, every one with ``register(subparsers)`` and a
``cmd_*(args)`` that returns the exit code. :mod:`dlm_toolkit.cli` lists them in ``COMMANDS``."""
