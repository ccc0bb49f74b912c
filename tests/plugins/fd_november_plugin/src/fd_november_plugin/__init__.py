"""Plugins as a third party wrote them in November 2026, from the docs of hookspec version 1:
a LIFO scheduler overriding ``admission_order`` (as docs/plugins.md then showed), hook
implementations, and a resource manager with version 1's ``abort`` method."""
