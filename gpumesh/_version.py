"""The package version, kept in one place (read by pyproject and by HELLO)."""

__version__ = "0.1.0"
