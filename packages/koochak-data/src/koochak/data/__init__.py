"""koochak.data."""

__all__: list[str] = []
