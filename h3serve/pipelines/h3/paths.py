"""Where h3serve keeps what it writes for later: the random tiny checkpoints, the default video job store."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("H3SERVE_CACHE", Path.home() / ".cache" / "h3serve"))
