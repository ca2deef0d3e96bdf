"""What runs in the engine-core process: requests, the scheduler, the KV cache
manager and its block pool, and ``EngineCore`` with its process loop.

Nothing here tokenizes or detokenizes: the core sees token IDs only. The API
side (``minivllm.engine``) turns text into token IDs and back.
"""
