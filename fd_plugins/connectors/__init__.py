"""Built-in connectors of prefill/decode instances: ``zmq`` (TCP, across hosts) and ``shm`` (same host)."""
