"""Composition: the layer that wires the components into processes and clusters.

It sits above everything else and is the only package that imports router/, prefill_worker/,
decode_worker/ and bench/ together; the core (splitserve/) imports none of them.
  cli.py            the `splitserve` command: flags → each component's frozen config
  worker.py         one worker process: the role's servicer plugged into the shared lifecycle
  local.py          `splitserve up`: router + workers as child processes on this host
  local_generate.py one in-process engine, no cluster
Deployment files live beside it: k8s/ (manifests), docker/ (image), grafana/ (dashboard).
"""
