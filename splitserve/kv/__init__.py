"""KV transfer: a vLLM KV connector that pulls a prompt's KV blocks over torch.distributed.

Modules, in the order a transfer touches them:
  connector.py     vLLM-facing facade: scheduler half (which blocks, leases) + worker half hooks.
  producer.py      prefill side, worker process: holds blocks under lease, serves pulls.
  consumer.py      decode side, worker process: pulls blocks into freshly allocated block ids.
  spec.py          what both sides must agree on (checked at handshake).
  blocks.py        gather/scatter of whole blocks between the paged cache and a staging buffer.
  block_kernel.py  the same in one launch for every layer (CUDA, Triton).
  layered.py       a decode step's scatter beside the forward pass that reads it (opt-in).
  pair_channel.py  one 2-rank gloo/NCCL process group per (producer, consumer) pair.
  wire.py          side-channel framing and peer authentication.
  link.py          one side-channel connection's way for the bulk bytes, on either end.
  shm.py           the same-host path: a pull's bytes through a shared-memory segment.
  stats.py         per-transfer bytes/seconds/failures, shipped to the API process via vLLM.
And the records and books around them:
  ticket.py        the transfer contract: the KV of request R is held on producer P.
  settings.py      kv_connector_extra_config, typed.
  transfers.py     the producer's book of transfers: what it holds, for whom, what became of it.
  board.py         the producer's transfer counts in a small shared file.
  control.py       release of held KV from the prefill worker's server, through the engine.
"""
