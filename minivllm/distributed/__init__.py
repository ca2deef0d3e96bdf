"""What crosses engine boundaries: KV cache moved between engines and tiers
(``kv_transfer/``) and KV cache events for routers (``kv_events.py``).

Below ``core`` and ``worker`` in the import graph: the scheduler (core) and the
model runner (worker) import and call what is here, never the other way.
"""
