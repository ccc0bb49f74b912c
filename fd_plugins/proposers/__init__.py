"""Built-in speculative proposers: ``ngram`` (prompt lookup)."""
