"""vLLM's ``kv_transfer_config`` (issue 33), checked before anything loads.

The connectors themselves live in ``minivllm/distributed/kv_transfer/``; this
only says which one, which way (``kv_role``) and with what extra settings, and
refuses anything else naming the field and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from minivllm.config.checks import bad, check_int, is_number
from minivllm.config.dict_args import config_dict

KV_CONNECTORS = ("SharedStorageConnector", "OffloadingConnector", "P2pConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_OFFLOADING_BACKENDS = ("native",)
# The kv_connector_extra_config keys each connector takes (required ones first).
_KV_EXTRA_KEYS = {
    "SharedStorageConnector": (("shared_storage_path",), ()),
    "OffloadingConnector": (("cpu_bytes",), ()),
    "P2pConnector": ((), ("host", "port", "timeout_s")),
}
_KV_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config", "engine_id")


@dataclass
class KVTransferConfig:
    """vLLM's ``kv_transfer_config``: which connector moves KV blocks, and which way.

    ``kv_role``: a ``kv_producer`` saves/sends the KV it computes, a
    ``kv_consumer`` loads/receives KV instead of computing it, ``kv_both``
    does both (an offload tier, a shared store used by one engine).
    ``--kv-offloading-size GiB`` is vLLM's shorthand for
    ``{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}`` with
    that much host memory.
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    engine_id: Optional[str] = None

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @staticmethod
    def from_dict(raw: Any) -> "KVTransferConfig":
        raw = config_dict("kv_transfer_config", raw, _KV_KEYS,
                          '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", '
                          '"kv_connector_extra_config": {"shared_storage_path": DIR}}')
        name = raw.get("kv_connector")
        if name not in KV_CONNECTORS:
            raise bad("kv_transfer_config.kv_connector", name,
                       f"must be one of {', '.join(KV_CONNECTORS)}")
        role = raw.get("kv_role", "kv_both")
        if role not in KV_ROLES:
            raise bad("kv_transfer_config.kv_role", role, f"must be one of {', '.join(KV_ROLES)}")
        extra = raw.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise bad("kv_transfer_config.kv_connector_extra_config", extra, "must be a dict")
        required, optional = _KV_EXTRA_KEYS[name]
        unknown = sorted(set(extra) - set(required) - set(optional))
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config has unknown "
                             f"key(s) {unknown} for {name}; allowed: "
                             f"{', '.join(required + optional) or 'none'}")
        for key in required:
            if key not in extra:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key} is "
                                 f"missing: {name} needs it")
        config = KVTransferConfig(name, role, dict(extra), raw.get("engine_id"))
        config._check_extra()
        return config

    def _check_extra(self) -> None:
        extra, where = self.kv_connector_extra_config, "kv_transfer_config.kv_connector_extra_config"
        path = extra.get("shared_storage_path")
        if path is not None and (not isinstance(path, str) or not path):
            raise bad(f"{where}.shared_storage_path", path, "must be a folder path")
        size = extra.get("cpu_bytes")
        check_int(f"{where}.cpu_bytes", size, 1, optional=True,
                  allowed="must be a positive integer (bytes)")
        timeout = extra.get("timeout_s")
        if timeout is not None and (not is_number(timeout) or timeout <= 0):
            raise bad(f"{where}.timeout_s", timeout, "must be a number of seconds > 0")
        check_int(f"{where}.port", extra.get("port"), 0, 65535, optional=True,
                  allowed="must be an integer in [0, 65535] (0: any free)")
        if self.kv_connector == "OffloadingConnector" and self.kv_role != "kv_both":
            raise bad("kv_transfer_config.kv_role", self.kv_role,
                       "the OffloadingConnector both stores and loads: use kv_both")
        if self.kv_connector == "P2pConnector" and self.kv_role == "kv_both":
            raise bad("kv_transfer_config.kv_role", self.kv_role,
                       "a P2pConnector engine is a kv_producer (prefill) or a kv_consumer (decode)")

    @staticmethod
    def from_engine_args(args) -> Optional["KVTransferConfig"]:
        """The checked config, or None; ``--kv-offloading-size`` builds one."""
        size, backend = args.kv_offloading_size, args.kv_offloading_backend
        if backend is not None and backend not in KV_OFFLOADING_BACKENDS:
            raise bad("kv_offloading_backend", backend,
                       f"must be one of {', '.join(KV_OFFLOADING_BACKENDS)}")
        if size is not None:
            if not is_number(size) or size <= 0:
                raise bad("kv_offloading_size", size, "must be a number of GiB > 0")
            if args.kv_transfer_config is not None:
                raise bad("kv_offloading_size", size, "cannot be combined with "
                           "kv_transfer_config (give one connector: the offloading one is "
                           '{"kv_connector": "OffloadingConnector", ...})')
            raw = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"cpu_bytes": int(size * (1 << 30))}}
        elif backend is not None:
            raise bad("kv_offloading_backend", backend, "needs kv_offloading_size (GiB)")
        elif args.kv_transfer_config is None:
            return None
        else:
            raw = args.kv_transfer_config
        config = KVTransferConfig.from_dict(raw)
        # Connectors name blocks by the prefix cache's hash chain, on one rank.
        if not args.enable_prefix_caching:
            raise bad("enable_prefix_caching", False, f"{config.kv_connector} names blocks "
                       "by their prefix-cache hashes: needs enable_prefix_caching=True")
        if args.tensor_parallel_size != 1:
            raise bad("tensor_parallel_size", args.tensor_parallel_size,
                       f"{config.kv_connector} supports 1 only")
        if args.speculative_config is not None:
            raise bad("speculative_config", args.speculative_config,
                       f"cannot be combined with {config.kv_connector} (not supported yet)")
        return config


__all__ = ["KVTransferConfig", "KV_CONNECTORS", "KV_ROLES", "KV_OFFLOADING_BACKENDS"]
