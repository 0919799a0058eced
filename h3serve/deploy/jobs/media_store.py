"""Where video jobs keep their files: a local directory (a PVC on Kubernetes) or any fsspec URL (s3://, gs://...).

Flat and small on purpose: whole-file puts that readers see entirely or not at all, gets, deletes and a
name listing. Local puts write a temporary file and rename it (atomic on POSIX, NFS included); object
stores make a single PUT visible atomically, so fsspec URLs write in place. Names starting with "."
are the store's own temporaries and never listed.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from h3serve.pipelines.h3.paths import cache_dir

if TYPE_CHECKING:
    from h3serve.deploy.common.args import JobStoreArgs


def store_url(config: JobStoreArgs, app_name: str) -> str:
    """This application's part of the configured store (default: a directory under the h3serve cache)."""
    base = config.store or str(cache_dir() / "videos")
    return f"{base.rstrip('/')}/{app_name}"


class StoreError(RuntimeError):
    """The configured store cannot be used (not writable, no credentials, unknown protocol...)."""


class MediaStore:
    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url
        try:
            if "://" not in url or url.startswith("file://"):
                self.fs = None
                self.root = Path(os.path.expanduser(url.removeprefix("file://")))
                self.root.mkdir(parents=True, exist_ok=True)
            else:
                import fsspec

                self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
                self.root = root.rstrip("/")
        except Exception as e:  # no such protocol, its package missing, a file in the way...
            raise self._unusable(e) from e

    def _path(self, name: str) -> str:
        if "/" in name or name.startswith("."):
            raise ValueError(f"not a store name: {name!r}")
        return str(self.root / name) if self.fs is None else f"{self.root}/{name}"

    def put(self, name: str, data: bytes) -> None:
        """Write ``name`` whole: a reader sees the previous content or this one, never a part."""
        path = self._path(name)
        if self.fs is not None:
            self.fs.pipe_file(path, data)
            return
        temp = self.root / f".{name}.{uuid.uuid4().hex}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def put_new(self, name: str, data: bytes) -> bool:
        """Write ``name`` only if it does not exist: True when this call created it. Exclusive on a local directory
        (a hard link fails on an existing name); on an fsspec store a check then a write (not atomic)."""
        path = self._path(name)
        if self.fs is not None:
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True
        temp = self.root / f".{name}.{uuid.uuid4().hex}.tmp"
        with open(temp, "xb") as f:
            f.write(data)
        try:
            os.link(temp, path)
            return True
        except FileExistsError:
            return False
        finally:
            temp.unlink(missing_ok=True)

    def get(self, name: str) -> bytes | None:
        path = self._path(name)
        try:
            if self.fs is None:
                return Path(path).read_bytes()
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        path = self._path(name)
        return os.path.exists(path) if self.fs is None else self.fs.exists(path)

    def delete(self, *names: str) -> None:
        """Remove ``names``; a name already gone (another replica got there first) is fine."""
        for name in names:
            path = self._path(name)
            try:
                if self.fs is None:
                    os.unlink(path)
                else:
                    self.fs.rm_file(path)
            except FileNotFoundError:
                pass

    def names(self) -> list[str]:
        try:
            if self.fs is None:
                entries = os.listdir(self.root)
            else:
                self.fs.invalidate_cache(self.root)  # other replicas write here too
                entries = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        return sorted(e for e in entries if not e.startswith("."))

    def remove_stale_temporaries(self, older_than_s: float) -> None:
        """Temporaries a writer left when it died mid-put (local directories only)."""
        if self.fs is not None:
            return
        cutoff = time.time() - older_than_s
        for entry in os.scandir(self.root):
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                try:
                    if entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    pass

    def check(self) -> None:
        """Fail now, with a message naming the store, rather than on the first finished video."""
        name = f"probe-{uuid.uuid4().hex}"
        try:
            self.put(name, b"h3serve")
            if self.get(name) != b"h3serve":
                raise OSError("what was written could not be read back")
            self.delete(name)
        except Exception as e:
            raise self._unusable(e) from e

    def _unusable(self, error: Exception) -> StoreError:
        return StoreError(
            f"the video job store {self.url!r} is not usable: {type(error).__name__}: {error}. Set "
            "jobs.store in the serve config to a writable directory shared by every ingress replica (a "
            "ReadWriteMany PVC on Kubernetes) or an fsspec URL such as s3://bucket/prefix"
        )
