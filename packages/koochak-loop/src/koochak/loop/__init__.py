"""koochak.loop."""

__all__: list[str] = []
