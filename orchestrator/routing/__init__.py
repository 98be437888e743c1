"""Routing: which worker serves a leg (``policies``) and whether to skip the ctx leg (``conditional``)."""

from orchestrator.routing.conditional import should_skip_ctx
from orchestrator.routing.policies import Candidate, Router, RouteRequest, make_router

__all__ = ["Candidate", "RouteRequest", "Router", "make_router", "should_skip_ctx"]
