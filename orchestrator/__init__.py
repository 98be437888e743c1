"""The orchestrator: one OpenAI/Anthropic URL in front of ctx and gen workers.

Modules (one concept each):

- ``config``      the frozen, typed OrchestratorConfig (``typed`` builds it from YAML/JSON)
- ``server``      one serving process of ``disagg orchestrator`` (K_o on one port), its exit deadline
- ``keeper``      ``disagg orchestrator`` itself: starts, respawns, adopts and stops the serving processes
- ``process_group`` the keeper's processes; ``process_records`` their pids in the state dir (for ``down``)
- ``leadership``  which serving process owns the shared state (a lock), and the hand-over when it dies
- ``state``       the leader's state owner and its Unix-socket app (registry, KV index, loads, perf)
- ``state_protocol`` the typed messages of the state socket and of worker registration
- ``health``      the leader's loop: health checks, /worker_info, KV-event drains, TTL expiry
- ``view``        each process's view of the cluster (snapshots + own load) and its link to the owner
- ``registry``    workers: static and registered, TTL, health thresholds
- ``kv_index``    which worker holds which blocks (from KV-cache events)
- ``routing``     round_robin / least_load / kv_cache_aware / session; conditional disaggregation
- ``prompt``      tokenize once, session ids, the ctx and gen leg bodies
- ``flow``        the two-phase request: legs, retries, streaming relay, timeouts, cancellation
- ``app``         the HTTP routes, API key, error shapes
- ``metrics``     Prometheus (multiprocess); ``perf`` joins /perf_metrics across orchestrator and workers
- ``prometheus_sd`` the file_sd target files the leader keeps for a deployment's prometheus.yml
- ``errors``      the orchestrator's additions to ``api.errors``

Never imports torch (tests/orchestrator/test_e2e.py checks it).
"""
