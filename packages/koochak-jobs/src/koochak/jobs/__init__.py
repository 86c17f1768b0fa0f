"""koochak.jobs."""

__all__: list[str] = []
