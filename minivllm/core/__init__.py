"""What runs in the engine-core process: requests, the scheduler, the KV cache manager and
its block pool, and ``EngineCore`` with its process loop. The core sees token IDs only: the
API side (``minivllm.engine``) turns text into token IDs and back."""
