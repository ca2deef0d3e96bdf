"""The speculative-decoding section: vLLM's ``speculative_config`` dict, checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from minivllm.config.checks import bad, check_int
from minivllm.config.dict_args import config_dict
from minivllm.config.model import ModelConfig

SPECULATIVE_METHODS = ("ngram", "draft_model")
# Left out of the dict, disable_by_batch_size is this: a batch this large is
# compute-bound on a CPU, so verifying rejected drafts costs more than the steps
# saved. `minivllm bench spec-decode` measures where plain chat starts losing
# (chapter 17 shows it). An explicit None keeps speculation on at any batch size.
DEFAULT_DISABLE_BY_BATCH_SIZE = 12
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max",
                     "prompt_lookup_min", "model", "disable_by_batch_size")


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config`` dict, checked (see minivllm/spec_decode/).

    ``ngram``: propose the ``num_speculative_tokens`` tokens that followed the
    earliest earlier occurrence of the request's last n tokens, for the largest
    n in [prompt_lookup_min, prompt_lookup_max] that occurs. One bound given
    sets the other, as in vLLM; neither given is 2..5 (vLLM: 5..5), so that
    short repeats are drafted for too. ``draft_model``:
    a smaller model with the target's vocabulary proposes them.
    ``disable_by_batch_size``: no drafts in steps with at least this many
    running requests (a large batch is compute-bound: verifying rejected
    drafts then costs more than the steps it saves); left out, it is
    ``DEFAULT_DISABLE_BY_BATCH_SIZE``, and an explicit None means never.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    model: Optional[str] = None
    disable_by_batch_size: Optional[int] = None

    @staticmethod
    def from_dict(raw: Any) -> "SpeculativeConfig":
        raw = config_dict("speculative_config", raw, _SPECULATIVE_KEYS,
                          '{"method": "ngram", "num_speculative_tokens": 3}')
        if raw.get("method") is None and raw.get("model") is not None:
            raw["method"] = "draft_model"  # as vLLM: a model alone means a draft model
        method = raw.get("method")
        if method not in SPECULATIVE_METHODS:
            raise bad("speculative_config.method", method,
                       f"must be one of {', '.join(SPECULATIVE_METHODS)}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config.num_speculative_tokens is missing: "
                             "must be an integer >= 1 (tokens proposed per step)")

        def count(name: str) -> Optional[int]:
            return check_int(f"speculative_config.{name}", raw.get(name), 1, optional=True,
                             allowed="must be an integer >= 1")

        raw.setdefault("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        config = SpeculativeConfig(method, count("num_speculative_tokens"),
                                   count("prompt_lookup_max"), count("prompt_lookup_min"),
                                   raw.get("model"), count("disable_by_batch_size"))
        if method == "ngram":
            config._resolve_ngram()
        else:
            config._check_draft_model()
        return config

    def _resolve_ngram(self) -> None:
        if self.model is not None:
            raise bad("speculative_config.model", self.model,
                       'only the "draft_model" method takes a model')
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        # As vLLM: one bound given sets the other.
        if lo is None and hi is None:
            lo, hi = 2, 5
        self.prompt_lookup_min = hi if lo is None else lo
        self.prompt_lookup_max = lo if hi is None else hi
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad("speculative_config.prompt_lookup_min", self.prompt_lookup_min,
                       f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")

    def draft_model_config(self, target: ModelConfig, tensor_parallel_size: int,
                           max_model_len: int, device: str = "cpu") -> ModelConfig:
        """The draft model's architecture, checked against the target's before anything
        is loaded or started: every error names ``speculative_config.model``."""
        if tensor_parallel_size != 1:
            raise bad("speculative_config.method", self.method,
                       f"is not supported with tensor_parallel_size={tensor_parallel_size}: "
                       "use 1, or the ngram method")
        try:  # a folder by now: minivllm.model.resolve converted a .gguf file
            draft = ModelConfig.from_pretrained(self.model, target.dtype, device)
        except (OSError, ValueError, KeyError) as e:
            raise bad("speculative_config.model", self.model,
                       f"is not a model folder minivllm can load ({e})") from None
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model={self.model!r} has vocab_size="
                             f"{draft.vocab_size}: a draft model must share the target's "
                             f"vocabulary (vocab_size={target.vocab_size})")
        if draft.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model={self.model!r} has "
                             f"max_position_embeddings={draft.max_position_embeddings}: a "
                             f"draft model must cover max_model_len={max_model_len}")
        return draft

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise bad("speculative_config.model", self.model,
                       "the draft_model method needs the path of a model folder")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None:
                raise bad(f"speculative_config.{name}", getattr(self, name),
                           'only the "ngram" method takes it')


__all__ = ["SpeculativeConfig", "SPECULATIVE_METHODS", "DEFAULT_DISABLE_BY_BATCH_SIZE"]
