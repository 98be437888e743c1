"""A deployment in simulated time (``disagg simulate``): the orchestrator's real routers and KV index over
engines whose real schedulers and block managers step on the synthetic timing model's clock.

``engine`` (one engine's steps in simulated time), ``cluster`` (routing, the two-phase flow, KV
pulls), ``replay`` (a trace through a deployment YAML, the command). Imports no torch.
"""

from disagg.sim.cluster import SimCluster, SimTiming
from disagg.sim.replay import simulate_trace

__all__ = ["SimCluster", "SimTiming", "simulate_trace"]
