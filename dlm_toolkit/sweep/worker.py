"""One sweep worker process: ``python -m dlm_toolkit.sweep.worker PAYLOAD_JSON`` (started by run_sweep)."""

from __future__ import annotations

import json
import os
import sys

from dlm_toolkit.config import ConfigError


def main(argv: list[str]) -> int:
    from dlm_toolkit.sweep.study import worker_main

    try:
        return worker_main(json.loads(argv[0]))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Every storage/tracking write is committed synchronously; skip the slow interpreter teardown
    # (torch, SQLAlchemy pools, MLflow) so the coordinator sees the worker finish promptly.
    os._exit(code)
