"""What every role shares and none owns: process control (``processes``, ``process_identity``),
restart budgets, the log format, the KV block hashes every role computes alike (``block_hash``)
and the configuration error.

Below every other package: it imports none of them (``tests/test_layering.py``)."""
