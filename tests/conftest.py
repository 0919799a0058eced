import os
import tempfile
from pathlib import Path

import pytest

# Keep generated tiny weights out of the user's home, shared by every test (and the Ray
# workers and subprocesses they start, which inherit the environment).
os.environ.setdefault("H3SERVE_CACHE", str(Path(tempfile.gettempdir()) / "h3serve-test-cache"))


@pytest.fixture(scope="session")
def tiny_pipeline():
    from pipelines.h3 import load_pipeline

    return load_pipeline("tiny")
