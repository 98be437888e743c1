"""Workers: the launcher, the engine process and its IPC protocol.

Only ``workers.engine.model`` and the real executor import torch; everything a
frontend uses from here (protocol, sampling params, config) stays torch-free.
"""
