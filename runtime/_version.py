"""The library's version: one place, read by the package metadata, the artifacts'
cache keys and ``precompile.__version__``."""

__version__ = "0.3.0.dev0"
