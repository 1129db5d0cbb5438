"""splitserve on Ray: the router and the prefill and decode pools as Ray actors.

The Python API (`deploy`, `connect`, `Deployment`) and `splitserve ray up|scale|status|down`
(cli.py). It lives in the composition layer, not in the core: it starts processes of every
package (tests/test_layering.py keeps `splitserve/` free of it).
  config.py     RayConfig (frozen), Secrets, AutoscaleConfig; the command of each component
  component.py  the actor that supervises one component process (restart, drain)
  controller.py the named actor holding a deployment: start, scale, status, shutdown
  autoscale.py  SLO-driven pool sizes from the router's own metrics (optional)
  api.py        deploy() / connect() → Deployment (.scale, .status, .shutdown)
"""

from __future__ import annotations

__all__ = ["AutoscaleConfig", "Deployment", "RayConfig", "connect", "deploy"]


def __getattr__(name: str):
    # Lazy: `splitserve --help` builds the `ray` subcommand without importing Ray (~1 s).
    if name in ("Deployment", "connect", "deploy"):
        from deploy.ray import api

        return getattr(api, name)
    if name in ("AutoscaleConfig", "RayConfig"):
        from deploy.ray import config

        return getattr(config, name)
    raise AttributeError(name)
