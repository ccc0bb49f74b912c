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
when no prefill instance is registered it waits up to ``stall_timeout_s`` for one to appear;
on the prefill side, its blocks are freed. Messages of an earlier attempt are ignored. A
client abort (or any end) on the decode side sends ``ABORT``; a prefill instance that cannot take
a request (queue full) answers ``ABORT`` at once and the next instance is asked. A reserved
request preempted on the decode side gives up its hand-off and recomputes its prompt locally.
"""
