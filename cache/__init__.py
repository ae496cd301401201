"""Content-addressed on-disk cache of precompile artifacts (see issue 2/5: not built yet)."""

__all__: list[str] = []
