"""One sweep worker process, started by ``run_sweep`` with :func:`~dlm_toolkit.sweep.study.worker_command`
(``python -I``, an explicit import path) or by hand: ``python -m dlm_toolkit.sweep.worker [PAYLOAD_JSON]``.

Without an argument it imports the heavy libraries first, then reads the payload as one JSON
line from stdin, so its start-up overlaps the coordinator's checks; EOF means "not needed".
"""

from __future__ import annotations

import json
import os
import sys

from dlm_toolkit.config import ConfigError


def main(argv: list[str]) -> int:
    try:
        import mlflow  # noqa: F401  -- the slow imports, before waiting for orders
        import optuna  # noqa: F401
        import torch  # noqa: F401

        import dlm_toolkit.evaluate  # noqa: F401
        from dlm_toolkit.sweep.study import worker_main

        line = argv[0] if argv else sys.stdin.readline()
        if not line.strip():
            return 0
        return worker_main(json.loads(line))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entry(argv: list[str] | None = None) -> None:
    code = main(argv or [])
    sys.stdout.flush()
    sys.stderr.flush()
    # Every storage/tracking write is committed synchronously; skip the slow interpreter teardown
    # (torch, SQLAlchemy pools, MLflow) so the coordinator sees the worker finish promptly.
    os._exit(code)


if __name__ == "__main__":
    entry(sys.argv[1:])
