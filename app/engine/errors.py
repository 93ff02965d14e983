"""Errors the engine reports to its users: each says what failed and, where it can, what to do."""


class EngineError(Exception):
    """Base class: an error with a message meant for the user."""


class ModelLoadError(EngineError):
    """A model folder could not be loaded: names the file and the reason."""

    def __init__(self, reason: str, path: str | None = None):
        self.reason = reason
        self.path = path
        super().__init__(f"{path}: {reason}" if path else reason)


class UnsupportedArchitectureError(ModelLoadError):
    pass
