"""koochak.storage."""

__all__: list[str] = []
