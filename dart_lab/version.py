"""The package's version, recorded in every result (bench, tables); pyproject.toml's `version` is the same number."""
__version__ = "0.2.0"
