"""Why an attention backend was refused. Each error carries a metric-friendly reason."""

from __future__ import annotations


class AttentionSelectionError(RuntimeError):
    """Base of every selection failure. ``reason`` is a short label for metrics."""

    reason = "error"

    def __init__(self, message: str, *, backend: str | None = None, model: str | None = None):
        super().__init__(message)
        self.backend = backend
        self.model = model

    def __reduce__(self):  # keep the attributes when Ray ships the error between processes
        return _rebuild, (type(self), str(self), dict(self.__dict__))


def _rebuild(cls, message, state):
    error = cls.__new__(cls)
    RuntimeError.__init__(error, message)
    error.__dict__.update(state)
    return error


class AdmissionError(AttentionSelectionError):
    """The backend cannot do what the model needs (a static, code-derived fact)."""

    reason = "incapable"

    def __init__(
        self,
        message: str,
        *,
        backend: str | None = None,
        model: str | None = None,
        missing: tuple[str, ...] = (),
        reason: str | None = None,
    ):
        super().__init__(message, backend=backend, model=model)
        self.missing = missing
        if reason is not None:
            self.reason = reason


class BackendUnavailable(AttentionSelectionError):
    """The backend could do it, but cannot run on that node (library, GPU, dtype...)."""

    reason = "unavailable"


class UnknownBackendError(AttentionSelectionError, ValueError):
    """The name matches no backend or alias."""

    reason = "unknown_backend"
