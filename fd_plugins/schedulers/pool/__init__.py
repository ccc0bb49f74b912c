"""The ``global`` request scheduler: a pool of instances sharing one Redis server (see scheduler.py)."""
