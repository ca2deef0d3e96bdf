"""Prompt + parameters → the engine request: the first stage of every request.

A prompt is a string, token IDs, chat messages (the chat template renders them, special
tokens included), or a dict of one and a ``cache_salt`` (prompt_dict.py). Every check
against this model and engine is made here, once (an ``InvalidRequestError`` naming the
field), and ``bad_words`` are tokenized; whether KV blocks suffice the scheduler knows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from minivllm.config import EngineConfig, InvalidRequestError, is_int
from minivllm.inputs.tokenizer import load_tokenizer, read_eos_token_ids
from minivllm.sampling_params import OPTIONAL_KNOBS, SamplingParams

Message = dict
PromptType = Union[str, Sequence[int], Sequence[Message], dict]


@dataclass
class EngineCoreRequest:
    """An accepted request: the output processor tracks it, the engine core runs it."""

    request_id: str
    prompt: Optional[str]  # the text (rendered chat template), None for token IDs
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # with bad_words_token_ids set
    max_tokens: int  # resolved: SamplingParams' None means "up to max_model_len"
    eos_token_ids: frozenset[int]
    arrival_time: float
    priority: int = 0
    lora_request: object = None  # a minivllm.LoRARequest, or None
    cache_salt: Optional[str] = None  # prefix-cache hits only under the same salt


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer=None) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model.path) if tokenizer is None else tokenizer
        self.eos_token_ids = read_eos_token_ids(config.model.path, self.tokenizer)
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = config.model.vocab_size
        self.classifier = "ForSequenceClassification" in "".join(  # num_labels outputs, no vocab
            config.model.hf_config.get("architectures") or ())

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: float, priority: int = 0,
                       lora_request=None) -> EngineCoreRequest:
        """Tokenize and check a request; the engine request, or ``InvalidRequestError``."""
        if isinstance(prompt, dict):  # vLLM's form (a module the plain path never loads)
            from minivllm.inputs.prompt_dict import split_prompt
        prompt, salt = split_prompt(prompt) if isinstance(prompt, dict) else (prompt, None)
        text, token_ids = self.tokenize(prompt)
        if self.classifier:  # a score head serves pooling requests only
            from minivllm.pooling.params import refuse_generation
            refuse_generation(self.config.model.architecture, params)
        self.check_params(params)
        max_tokens = self.check_length(len(token_ids), params)
        if priority != 0 or not is_int(priority) or lora_request is not None:
            from minivllm.inputs.request_checks import check_priority, lora_checker
            check_priority(self, priority)
            if lora_request is not None:
                lora_checker(self).check(lora_request)
        if params.bad_words:
            from minivllm.inputs.bad_words import with_bad_words
            params = with_bad_words(self.tokenizer, params)
        if params.retention_directives is not None:  # (agent sessions)
            from minivllm.inputs.retention import with_retention
            params = with_retention(params)
        return EngineCoreRequest(request_id, text, token_ids, params, max_tokens,
                                 self.eos_token_ids, arrival_time, priority, lora_request, salt)

    # -- the prompt ----------------------------------------------------------------
    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    chat_template: Optional[str] = None) -> str:
        """The prompt text of chat messages (inputs/chat_template.py)."""
        from minivllm.inputs.chat_template import render_chat
        return render_chat(self.tokenizer, messages, add_generation_prompt, chat_template)

    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """(prompt text or None, prompt token IDs) for any accepted prompt form."""
        if self.tokenizer is None and (isinstance(prompt, str) or any(
                isinstance(m, dict) for m in prompt)):
            raise InvalidRequestError("this model folder has no tokenizer: give prompts as "
                                      "token IDs", "prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            text = self.render_chat(items)
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        if not all(is_int(t) for t in items):
            raise InvalidRequestError("prompt must be a string, a list of token IDs or a list "
                                      "of chat messages", "prompt")
        self.check_token_ids("prompt_token_ids", items, "prompt")
        return None, items

    def check_length(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Validate the prompt length and resolve ``max_tokens``; returns the cap."""
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty: at least one token is needed",
                                      "prompt")
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens, but max_model_len is "
                f"{self.max_model_len}: it leaves no room to generate a token", "prompt")
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens and max_tokens is "
                f"{params.max_tokens}: together {num_prompt_tokens + params.max_tokens} "
                f"exceed max_model_len={self.max_model_len}", "max_tokens")
        return params.max_tokens

    # -- the parameters against this model -------------------------------------------
    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: it needs the model."""
        self.check_token_ids("SamplingParams.stop_token_ids", params.stop_token_ids,
                             "stop_token_ids")
        if any(getattr(params, name) is not None for name in OPTIONAL_KNOBS):
            from minivllm.inputs.knob_checks import check_knobs
            check_knobs(self, params)

    def check_token_ids(self, name: str, ids, param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"{name} contains {bad[:5]}: token IDs must be in "
                                      f"[0, {self.vocab_size})", param)


__all__ = ["EngineCoreRequest", "InputProcessor", "PromptType"]
