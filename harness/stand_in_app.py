"""`python -m harness.stand_in_app [--host H] [--port P]`: the service (`python -m app`) with the device
stand-in (`harness.stand_in`) in place of a GPU, timed as STAND_IN_MODEL (vit-s16 or vit-b16), STAND_IN_SLOWER
times as long (default 1: the H200's times), switched to the model a file STAND_IN_SWITCH names once written, each
model's load STAND_IN_LOAD_S seconds longer (default 0).

Installed at import, so also in the engine process that VIT_WORKERS > 1 spawns from this module. `uvicorn
harness.stand_in_app:app` serves the same as `uvicorn app.main:app` does. For benchmarks and tests only:
`python -m bench.stand_in` runs it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from app.startup import read_settings
from harness.stand_in import install

switch = os.environ.get("STAND_IN_SWITCH")
install(
    os.environ.get("STAND_IN_MODEL", "vit-b16"),
    read_settings().max_batch_size,
    float(os.environ.get("STAND_IN_SLOWER", "1")),
    Path(switch) if switch else None,
    float(os.environ.get("STAND_IN_LOAD_S", "0")),
)

from app.main import app  # noqa: E402  (after the stand-in is installed)

__all__ = ["app"]

if __name__ == "__main__":
    from app.__main__ import main

    sys.exit(main())
