"""Prompt → token IDs: the first stage of every request.

A prompt may be a string, a list of token IDs, or a list of chat messages
(``[{"role": "user", "content": "..."}]``). Chat messages go through the
model's chat template first, which adds the role markers and special tokens
the model was trained with; the rendered text is then tokenized without
adding any more special tokens (the template already placed them).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from minivllm.config import is_int
from minivllm.sampling_params import SamplingParams

Message = dict
PromptType = Union[str, Sequence[int], Sequence[Message]]


class InputProcessor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    chat_template: Optional[str] = None) -> str:
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]={m!r} is invalid: each message must be a "
                                 f"dict with 'role' and 'content'")
        if self.tokenizer.chat_template is None and chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; pass "
                             "chat_template=... or use a plain prompt")
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template)

    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """(prompt text or None, prompt token IDs) for any accepted prompt form."""
        if self.tokenizer is None and (isinstance(prompt, str) or any(
                isinstance(m, dict) for m in prompt)):
            raise ValueError("this model folder has no tokenizer: give prompts as token IDs")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            text = self.render_chat(items)
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        if not all(is_int(t) for t in items):
            raise ValueError("prompt must be a string, a list of token IDs or a list of "
                             "chat messages")
        bad = [t for t in items if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[:5]}: token IDs must be in "
                             f"[0, {self.vocab_size})")
        return None, items

    def check_token_fields(self, params: SamplingParams) -> None:
        """Token ids in logit_bias / allowed_token_ids must exist in this vocabulary."""
        for name, ids in (("logit_bias", params.logit_bias or {}),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name} has token ids {bad[:5]}: they must "
                                 f"be in [0, {self.vocab_size})")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer, and this model "
                             "folder has none")

    def check_length(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Validate the prompt length and resolve ``max_tokens``; returns the cap."""
        self.check_token_fields(params)
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens, but max_model_len is "
                f"{self.max_model_len}: it leaves no room to generate a token")
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens and max_tokens is "
                f"{params.max_tokens}: together {num_prompt_tokens + params.max_tokens} "
                f"exceed max_model_len={self.max_model_len}")
        return params.max_tokens
