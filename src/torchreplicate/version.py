"""The package version, in one place (pyproject reads it)."""

__version__ = "0.2.0.dev0"
