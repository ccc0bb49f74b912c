"""Prefill/decode disaggregation (splitwise): the hand-off protocol, identical over every connector.

A decode instance (``splitwise.role = "decode"``) takes each request from its own front end:

1. it **reserves** the blocks of the whole prompt (``ResourceManager.reserve``); with no room
   the request waits (in order) until blocks free up, so no prefill instance computes KV that
   nobody can take;
2. it picks the least loaded compatible prefill instance from the peer directory (the
   ``splitwise`` scheduler) and sends it ``PREFILL`` (the request, attempt number);
3. the prefill instance queues the prompt like any request (chunked like any); once the prompt
   is computed it ships its blocks (``BLOCK``: one block of every layer per message, straight
   from the cache), then the first sampled token (``DONE``); its blocks stay held, and a request
   whose blocks are shipping is never preempted;
4. the decode instance writes each block into its reserved block, and on ``DONE`` answers
   ``ACK``, emits the first token and decodes on; the prefill instance frees its blocks on ACK.

Both sides send ``ALIVE`` for their open hand-offs every ``splitwise.heartbeat_s``; a hand-off
that hears nothing for ``splitwise.stall_timeout_s`` is given up by that side (and ``ABORT``
sent). Given up on the decode side, the request is asked of another prefill instance (up to
``splitwise.max_prefill_attempts`` in all), keeping its reservation, then fails with an error;
when no usable prefill instance is registered it waits up to ``splitwise.peer_wait_s`` for one;
on the prefill side, its blocks are freed. Messages of an earlier attempt are ignored, and so
are messages about a hand-off (``BLOCK``, ``DONE``, ``ABORT``, an ``ALIVE``'s entry) from any
sender but the prefill instance its current attempt asked. The prefill side's ``ALIVE`` says
which hand-offs it sent every block and the ``DONE`` of; messages between two instances arrive
in order, so a decode side that hears so without the ``DONE`` (or gets a ``DONE`` with blocks
missing) knows a message was lost: it sends ``ABORT`` and asks again (the same instance may be
asked). A connector that does not take a ``BLOCK`` or the ``DONE`` makes the prefill side give
the hand-off up (``ABORT``, blocks freed). An instance shutting down sends its ``ABORT``s, then
``FLUSH``, and closes its connector once each peer answered ``FLUSHED`` (or after 2 x
``heartbeat_s``). A client abort (or any end) on the decode side sends ``ABORT``; a prefill
instance that cannot take a request (queue full) answers ``ABORT`` at once and the next instance
is asked. A reserved request preempted on the decode side gives up its hand-off and recomputes
its prompt locally.
"""
