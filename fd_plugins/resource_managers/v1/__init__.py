"""The ``v1`` KV resource manager package: token-budget scheduling over a prefix-cached block pool."""
