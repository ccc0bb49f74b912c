"""Importing this module fails, as a plugin with a missing dependency would."""

raise ImportError("fd_other_plugins needs the package 'frobnicate', which is not installed")
