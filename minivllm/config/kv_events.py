"""``kv_events_config``: where the block pool's prefix-cache changes are published
(BlockStored / BlockRemoved / AllBlocksCleared, see minivllm/distributed/kv_events.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Optional

from minivllm.config.checks import bad, check_bool, check_choice, check_int

KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass
class KVEventsConfig:
    """vLLM's ``kv_events_config``: where the block pool's cache changes are published.

    ``endpoint`` is the ZeroMQ PUB socket the engine binds (``tcp://*:5557``) or
    connects to (an address with a host); ``replay_endpoint`` an optional ROUTER
    socket where a subscriber that saw a gap in the sequence numbers asks for
    the batches it missed (the last ``buffer_steps`` are kept). ``topic`` is
    the first frame of every message. ``hwm``: messages queued per subscriber
    before ZeroMQ drops (the sequence number then tells the subscriber).
    """

    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None  # None: "zmq" when enabled (as vLLM)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @staticmethod
    def from_dict(raw: Any) -> Optional["KVEventsConfig"]:
        """None (nothing published) unless events are enabled; errors name the field."""
        if raw is None:
            return None
        if isinstance(raw, str):  # JSON, as on the command line
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise bad("kv_events_config", raw, f"must be a JSON object ({e})") from None
        if not isinstance(raw, dict):
            raise bad("kv_events_config", raw, "must be a dict")
        allowed = [f.name for f in fields(KVEventsConfig)]
        for key in raw:
            if key not in allowed:
                raise bad(f"kv_events_config[{key!r}]", raw[key],
                           f"unknown key; allowed: {', '.join(allowed)}")
        cfg = KVEventsConfig(**raw)
        if cfg.publisher is None:
            cfg.publisher = "zmq" if cfg.enable_kv_cache_events else "null"
        cfg._validate()
        return cfg if cfg.enable_kv_cache_events and cfg.publisher != "null" else None

    def _validate(self) -> None:
        check_bool("kv_events_config.enable_kv_cache_events", self.enable_kv_cache_events)
        check_choice("kv_events_config.publisher", self.publisher, KV_EVENT_PUBLISHERS)
        for name in ("endpoint", "replay_endpoint"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and "://" in v):
                raise bad(f"kv_events_config.{name}", v,
                           "must be a ZeroMQ address such as 'tcp://*:5557' or 'ipc:///tmp/kv'")
        for name in ("buffer_steps", "hwm"):
            check_int(f"kv_events_config.{name}", getattr(self, name), 1)
        if not isinstance(self.topic, str):
            raise bad("kv_events_config.topic", self.topic, "must be a string")


__all__ = ["KVEventsConfig", "KV_EVENT_PUBLISHERS"]
