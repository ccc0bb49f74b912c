"""A third-party fd-engine plugin: a LIFO scheduler, a demo platform and an ordering hook."""
