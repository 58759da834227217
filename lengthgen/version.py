"""The package version (read by `pyproject.toml` and recorded with every result)."""

__version__ = "0.1.0"
