"""koochak.events."""

__all__: list[str] = []
