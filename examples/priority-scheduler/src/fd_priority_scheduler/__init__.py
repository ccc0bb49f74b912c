"""Priority scheduling for fd-engine, as a hook plugin (the hooks live in :mod:`fd_priority_scheduler.hooks`)."""

__version__ = "0.1.0"
