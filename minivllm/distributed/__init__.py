"""What crosses engine boundaries: KV cache events for routers (kv_events.py)."""
