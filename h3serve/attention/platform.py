"""Where replicas will run: probed on a node, serialized to the driver."""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DeviceType = Literal["cpu", "cuda"]


def _torch_version() -> str:
    # torch is imported where a platform is probed or assumed, never at import: a process that only receives a
    # Platform (the ingress, in its deploy args) loads no model and must not pay torch's import
    import torch

    return torch.__version__


class Platform(BaseModel):
    """A node's attention-relevant facts. JSON round-trips via ``model_dump_json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device_type: DeviceType
    device_name: str = "cpu"
    compute_capability: tuple[int, int] | None = None
    torch_version: str = Field(default_factory=_torch_version)
    # importable kernel library -> version; absent means it does not import there
    kernel_libraries: dict[str, str] = Field(default_factory=dict)
    source: Literal["probed", "assumed"] = "assumed"
    # One device's memory in bytes (torch.cuda.get_device_properties().total_memory); None on CPU, where
    # ranks share host memory with everything else and no per-rank device budget exists.
    device_memory_bytes: int | None = Field(default=None, ge=1)

    def has_library(self, name: str) -> bool:
        return name in self.kernel_libraries

    def describe(self) -> str:
        sm = f" sm{self.compute_capability[0]}{self.compute_capability[1]}" if self.compute_capability else ""
        libs = ", ".join(f"{k} {v}" for k, v in sorted(self.kernel_libraries.items())) or "none"
        memory = f"; {self.device_memory_bytes / 2**30:.1f} GiB" if self.device_memory_bytes else ""
        return (
            f"{self.device_type}{sm} ({self.device_name}{memory}; torch {self.torch_version}; kernels: {libs}; "
            f"{self.source})"
        )

    @classmethod
    def cpu(cls, **kwargs) -> Platform:
        return cls(device_type="cpu", **kwargs)

    @classmethod
    def cuda(
        cls,
        compute_capability: tuple[int, int] = (9, 0),
        kernel_libraries: dict[str, str] | None = None,
        device_name: str = "assumed CUDA GPU",
        **kwargs,
    ) -> Platform:
        return cls(
            device_type="cuda",
            compute_capability=compute_capability,
            kernel_libraries=kernel_libraries or {},
            device_name=device_name,
            **kwargs,
        )


def library_version(module_name: str) -> str | None:
    """The version of an importable kernel library, or None if it does not import here."""
    try:
        module = importlib.import_module(module_name)
    except Exception:  # a broken CUDA extension raises more than ImportError
        return None
    version = getattr(module, "__version__", None)
    if version is None:
        top = module_name.split(".")[0]
        try:
            version = importlib.metadata.version(top)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
    return str(version)


def probe(device: DeviceType | None = None, libraries: Iterable[str] = ()) -> Platform:
    """Describe this node. ``device=None`` picks CUDA when a GPU is visible."""
    import torch

    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        return Platform(
            device_type="cpu",
            device_name="cpu (CUDA requested but torch.cuda.is_available() is False)",
            source="probed",
        )
    found = {}
    for name in libraries:
        version = library_version(name)
        if version is not None:
            found[name] = version
    if not use_cuda:
        return Platform(device_type="cpu", kernel_libraries=found, source="probed")
    index = torch.cuda.current_device()
    return Platform(
        device_type="cuda",
        device_name=torch.cuda.get_device_name(index),
        compute_capability=torch.cuda.get_device_capability(index),
        device_memory_bytes=torch.cuda.get_device_properties(index).total_memory,
        kernel_libraries=found,
        source="probed",
    )
