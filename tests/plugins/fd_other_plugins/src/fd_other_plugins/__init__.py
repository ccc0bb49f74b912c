"""Broken and clashing plugins: an import error, a stale hookspec version, name clashes, a misspelt hook."""
