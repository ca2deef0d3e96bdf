"""Moving KV cache between engines and tiers (``kv_transfer/``).

Below ``core`` and ``worker`` in the import graph: the scheduler (core) and the
model runner (worker) import and call the connectors here, never the other way.
"""
