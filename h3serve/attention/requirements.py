"""What a model needs from attention, stated as a semantic contract."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionRequirements:
    """Capabilities a model needs from its attention backend.

    Each field is one requirement. A backend meets requirement ``x`` when it has a
    ``supports_x()`` method that returns True, so adding a requirement touches only
    this class and the backends that can meet it.
    """

    packed_varlen: bool = dataclasses.field(
        default=False,
        metadata={"describe": "packed varlen attention"},
    )

    def required(self) -> tuple[str, ...]:
        """Names of the requirements that are switched on."""
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name))

    @staticmethod
    def describe(name: str) -> str:
        field = {f.name: f for f in dataclasses.fields(AttentionRequirements)}[name]
        return field.metadata.get("describe", name.replace("_", " "))

    def to_dict(self) -> dict[str, bool]:
        return dataclasses.asdict(self)
