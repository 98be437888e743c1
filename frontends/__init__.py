"""A worker's HTTP frontends: the engine client, the worker app, the launcher routes, the admin
forwarding of attached frontends, on the API package both servers share (``api``).

Never imports torch: frontends start in about a second and stay small.
"""
