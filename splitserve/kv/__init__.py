"""KV transfer: a vLLM KV connector that pulls a prompt's KV blocks from the producer holding them.

Modules, in the order a transfer touches them:
  connector.py     vLLM-facing facade: scheduler half (which blocks, leases) + worker half hooks.
  producer.py      prefill side, worker process: holds blocks under lease, serves pulls.
  consumer.py      decode side, worker process: pulls blocks into freshly allocated block ids.
  handshake.py     mutual proof of the secret, the spec check, the choice of transport.
  messages.py      the side channel's typed, versioned messages, encoded in one place.
  wire.py          side-channel framing and the proofs' HMAC.
  spec.py          what both sides must agree on (checked at handshake).
  transport/       the seam the two sides move bytes through, one module per path:
    __init__.py    the interface (offer/accept at the handshake, move, close).
    choice.py      which paths each side offers or takes, best first.
    pair.py        any two hosts: a 2-rank process group per connection (pair_channel.py).
    shm.py         one host: through the consumer's shared-memory segment.
    arena.py       one host, copy-out holds: read where they lie, in the producer's hold arena.
  pair_channel.py  one 2-rank gloo/NCCL process group per (producer, consumer) pair.
  shm.py           shared-memory segments: names, nonces, leak sweeps.
  blocks.py        gather/scatter of whole blocks between the paged cache and a staging buffer.
  block_kernel.py  the same in one launch for every layer (CUDA, Triton).
  layered.py       a decode step's scatter beside the forward pass that reads it (opt-in).
  stats.py         per-transfer bytes/seconds/failures, shipped to the API process via vLLM.
And the records and books around them:
  ticket.py        the transfer contract: the KV of request R is held on producer P.
  settings.py      kv_connector_extra_config, typed.
  transfers.py     the producer's book of transfers: what it holds, for whom, what became of it.
  board.py         the producer's transfer counts in a small shared file.
  control.py       release of held KV from the prefill worker's server, through the engine.
"""
