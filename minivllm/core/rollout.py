"""The engine core's side of the RL rollout API: weights in place, pause and resume.

An RL trainer (verl, OpenRLHF, TRL) keeps an engine alive across training
steps. Each step it generates rollouts, trains on them, then pushes the new
weights into the engine instead of starting a new one. ``LLM`` exposes that
with vLLM's names (``LLM_API``; ``LLM``'s methods, ``entrypoints/llm_rl.py``, call
here, so none of this loads for a plain request); each runs on the engine core,
between steps:

    llm.sleep(level=1)                      # free the KV cache while training
    ...                                     # the trainer's step
    llm.wake_up()
    llm.load_weights(model.named_parameters())   # (Hugging Face name, tensor)

- ``collective_rpc(method, args, kwargs)``: ``method`` on every rank's model
  runner (``minivllm/worker/rollout_worker.py``), results in rank order.
- ``load_weights(named_tensors)``: the new float weights on every rank (each
  keeps its tensor-parallel shard; all or nothing, ``model/weight_update.py``),
  then ``reset_prefix_cache``: every cached block holds K/V computed with the
  old weights, so no later request may hit one. Refused while a request is
  unfinished (its blocks hold such K/V too, and they cannot be cleared).
- ``reset_prefix_cache()``: forget every cached prefix, in the block pool
  (``AllBlocksCleared`` is published to KV-event subscribers) and in a KV
  connector's own cache (the offloading tier); False, changing nothing, while
  any block is held: by a request, or retained for a KV transfer.
- ``pause_generation()`` / ``resume_generation()``: while paused, ``step()``
  raises a clear error instead of running (an offline ``generate`` then ends,
  its requests aborted); requests can still be added, and run once resumed.
- ``sleep(level)`` / ``wake_up(tags)`` (``enable_sleep_mode=True``): free memory
  for the trainer between rollouts. Level 1 frees the KV cache and keeps the
  weights; level 2 frees the weights too. ``wake_up(["weights"])`` reloads the
  checkpoint (then ``load_weights`` the trainer's), ``wake_up(["kv_cache"])``
  allocates the cache again; the prefix cache was reset on sleeping. While
  anything sleeps, ``step()`` raises as when paused: a request gets a clear
  error, never an answer from missing memory. On the CPU the freed tensors go
  back to the system (``malloc_trim``); vLLM's level 1 on CUDA instead copies
  the weights to host memory, which minivllm does not do.
- The phased weight transfer, for a trainer in another process
  (``weight_transfer_config={"backend": "gloo"}``; the protocol and the
  trainer's side in ``distributed/weight_transfer.py``):
  ``init_weight_transfer_engine({"init_info": ...})`` joins every rank to the
  trainer's gloo group; ``start_weight_update()`` opens an update (refused on
  quantized weights, while requests are unfinished, or asleep);
  ``update_weights({"update_info": {names, dtype_names, shapes}})`` receives
  what the trainer broadcasts meanwhile, checking each tensor as
  ``load_weights`` does and staging it; ``finish_weight_update()`` applies
  the whole update and resets the prefix cache. A refused tensor drops the
  update (all or nothing across the calls), the engine unchanged.

On the server (``minivllm serve``) the same calls are vLLM's dev-mode routes,
off unless ``MINIVLLM_SERVER_DEV_MODE=1`` (``entrypoints/openai/dev_routes.py``):
they reach the engine-core process as ``UtilityCall`` messages
(``call_utility``), run between steps. A paused engine core idles: requests
sent meanwhile wait for resume. A sleeping one refuses them
(``EngineSleepingError``: a 503), so a request never waits on missing memory.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

PAUSED = ("generation is paused (pause_generation()): call resume_generation() before "
          "generating")
ASLEEP = "the engine is asleep (sleep(level={})): call wake_up() before generating"
SLEEP_TAGS = ("weights", "kv_cache")


# The calls ``LLM`` makes here (``entrypoints/llm_rl.py``), with vLLM's names.
LLM_API = ("collective_rpc", "load_weights", "reset_prefix_cache", "pause_generation",
           "resume_generation", "is_paused", "sleep", "wake_up", "is_sleeping",
           "init_weight_transfer_engine", "start_weight_update", "update_weights",
           "finish_weight_update")


class EngineSleepingError(RuntimeError):
    """A request reached an engine that sleeps: the server answers 503, the
    request was never run (offline, ``step()`` raises instead)."""


def call_utility(core, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
    """One call of ``LLM_API`` on the core, from the server (``engine_core_proc.py``)."""
    if method not in LLM_API:
        raise ValueError(f"method={method!r} is invalid: allowed {', '.join(LLM_API)}")
    return getattr(RolloutControl.of(core), method)(*args, **(kwargs or {}))


def sleeping_reason(core) -> Optional[str]:
    """Why ``core`` cannot take a request now (it sleeps), or None."""
    control = core.__dict__.get("rollout")
    return core.hold if control is not None and control.asleep else None


class RolloutControl:
    """Weight updates, prefix-cache resets and pauses of one engine core."""

    def __init__(self, core) -> None:
        self.core = core
        self.paused = False
        self.asleep: set[str] = set()  # of SLEEP_TAGS: what sleep() freed
        self.level = 0  # the deepest sleep() since the last full wake_up
        self.updating = False  # between start_weight_update() and finish_weight_update()

    @staticmethod
    def of(core) -> "RolloutControl":
        """The core's one control, made when the RL API is first used."""
        control = core.__dict__.get("rollout")
        if control is None:
            control = core.rollout = RolloutControl(core)
        return control

    # -- workers -------------------------------------------------------------------
    def collective_rpc(self, method: Union[str, Callable], args: tuple = (),
                       kwargs: Optional[dict] = None) -> list[Any]:
        return self.core.executor.collective_rpc(method, tuple(args), kwargs)

    def load_weights(self, named_tensors: Iterable) -> list[str]:
        """New weights on every rank, then the prefix cache cleared; returns the
        parameters updated (rank 0's names)."""
        self._check_updatable()
        updated = self.collective_rpc("load_weights", (list(named_tensors),))[0]
        if not self.reset_prefix_cache():  # cannot fail: no block is held (checked above)
            raise RuntimeError("the prefix cache could not be cleared after a weight update")
        return updated

    # -- the phased weight transfer (distributed/weight_transfer.py) -------------------
    def init_weight_transfer_engine(self, request) -> None:
        """Every rank joins the trainer's process group (``request``: vLLM's
        ``WeightTransferInitRequest`` or ``{"init_info": {...}}``); blocks until the
        trainer's ``trainer_init`` joins too."""
        if self.core.config.weight_transfer is None:
            raise ValueError("init_weight_transfer_engine() needs an engine built with "
                             "weight_transfer_config={'backend': 'gloo'}")
        self.collective_rpc("init_weight_transfer_engine", (request,))

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """Open an update; the weights change at ``finish_weight_update`` only."""
        if is_checkpoint_format is not True:
            raise ValueError(f"is_checkpoint_format={is_checkpoint_format!r} is invalid: "
                             f"minivllm takes Hugging Face checkpoint names only (True)")
        self._check_updatable()
        self.collective_rpc("start_weight_update")  # refuses quantized weights, then no group
        self.updating = True

    def update_weights(self, request) -> int:
        """Receive the tensors ``request``'s ``update_info`` announces (names,
        dtype_names, shapes), broadcast by the trainer meanwhile; each is checked as
        ``load_weights`` checks. A refused one drops the whole update (the engine
        unchanged) and raises naming it. Returns the number received."""
        if not self.updating:
            raise RuntimeError("update_weights() needs start_weight_update() first")
        try:
            return self.collective_rpc("update_weights", (request,))[0]
        except BaseException:
            self.updating = False
            raise

    def finish_weight_update(self) -> list[str]:
        """Apply the update on every rank, then clear the prefix cache (as
        ``load_weights``); returns the parameters updated (rank 0's names)."""
        if not self.updating:
            raise RuntimeError("finish_weight_update() needs start_weight_update() first "
                               "(an update with a refused weight was dropped)")
        self._check_updatable()  # refused now: the staged update waits for a retry
        self.updating = False
        updated = self.collective_rpc("finish_weight_update")[0]
        if not self.reset_prefix_cache():  # cannot fail: no block is held (checked above)
            raise RuntimeError("the prefix cache could not be cleared after a weight update")
        return updated

    def _check_updatable(self) -> None:
        if "weights" in self.asleep:
            raise RuntimeError("the weights are asleep (sleep(level=2)): wake_up(tags="
                               "['weights']) first (it reloads the checkpoint)")
        busy = self._busy()
        if busy is not None:
            raise RuntimeError(f"cannot update the weights while {busy}: their KV blocks "
                               f"were computed with the old weights; let them finish or "
                               f"abort them first")

    # -- the cache ---------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        core = self.core
        if core.scheduler.sending:  # blocks retained for a KV transfer in flight
            return False
        if not core.reset_prefix_cache():  # the block pool; publishes AllBlocksCleared
            return False
        if core.kv_connector is not None:  # a second tier (offloading) forgets too
            core.kv_connector.reset_cache()
        return True

    # -- pausing -------------------------------------------------------------------
    def pause_generation(self) -> None:
        self.paused = True
        self._set_hold()

    def resume_generation(self) -> None:
        self.paused = False
        self._set_hold()

    def is_paused(self) -> bool:
        return self.paused

    def _set_hold(self) -> None:
        self.core.hold = (ASLEEP.format(self.level) if self.asleep
                          else PAUSED if self.paused else None)

    # -- sleeping ------------------------------------------------------------------
    def sleep(self, level: int = 1) -> int:
        """Free the KV cache (level 1), or it and the weights (level 2), on every rank;
        returns the bytes of tensors freed (summed over the ranks)."""
        config = self.core.config
        if not config.enable_sleep_mode:
            raise ValueError("sleep() needs an engine built with enable_sleep_mode=True")
        if level not in (1, 2):
            raise ValueError(f"level={level!r} is invalid: must be 1 (free the KV cache) "
                             f"or 2 (the KV cache and the weights)")
        if config.kv_transfer is not None:
            raise ValueError("sleep() is not supported with a KV connector "
                             "(kv_transfer_config, kv_offloading_size): it holds the cache")
        busy = self._busy()
        if busy is not None:
            raise RuntimeError(f"cannot sleep while {busy}: let them finish or abort them")
        self.reset_prefix_cache()  # the cached blocks' K/V are about to be freed
        freed = sum(self.collective_rpc("sleep", (level,)))
        self.asleep |= {"kv_cache", "weights"} if level == 2 else {"kv_cache"}
        self.level = max(self.level, level)
        self._set_hold()
        return freed

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Bring back ``tags`` (default: both): "weights" reloads the checkpoint,
        "kv_cache" allocates the cache again (empty)."""
        tags = list(SLEEP_TAGS if tags is None else tags)
        unknown = sorted(set(tags) - set(SLEEP_TAGS))
        if unknown:
            raise ValueError(f"tags={tags!r} is invalid: {unknown} unknown; allowed: "
                             f"{list(SLEEP_TAGS)}")
        self.collective_rpc("wake_up", (tags,))
        self.asleep -= set(tags)
        if not self.asleep:
            self.level = 0
        self._set_hold()

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def _busy(self) -> Optional[str]:
        s = self.core.scheduler
        n = s.num_running + s.num_waiting + len(s.waiting_for_remote) + len(s.sending)
        return f"{n} requests are unfinished" if n else None


def reset_core_prefix_cache(core) -> bool:
    """``EngineCore.reset_prefix_cache``: the scheduler's (through the KV cache manager, the
    block pool's), then ``AllBlocksCleared`` published to KV-event subscribers."""
    done = core.scheduler.reset_prefix_cache()
    if core.kv_event_publisher is not None:
        core.publish_kv_events()
    return done


def reset_block_pool(pool) -> bool:
    """``BlockPool.reset_prefix_cache``: forget every cached hash; False, changing nothing,
    while a block is held."""
    if pool.num_free_blocks != pool.num_blocks:
        return False
    pool.retained = pool.retained and pool.retained.release_all()
    for block in pool.cached_block_hash_to_block.values():
        block.block_hash = None
    pool.cached_block_hash_to_block.clear()
    return True


__all__ = ["ASLEEP", "LLM_API", "PAUSED", "SLEEP_TAGS", "EngineSleepingError", "RolloutControl",
           "call_utility", "reset_block_pool", "reset_core_prefix_cache", "sleeping_reason"]
