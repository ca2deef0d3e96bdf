"""Chat messages → the prompt text, through the model's chat template (a Jinja template
the tokenizer carries). The template places the special tokens, so the text it gives is
tokenized without adding more. Loaded by the first chat request."""

from __future__ import annotations

from typing import Optional, Sequence

from minivllm.config import InvalidRequestError


def render_chat(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True,
                chat_template: Optional[str] = None) -> str:
    from jinja2 import TemplateError

    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequestError(f"messages[{i}]={m!r} is invalid: each message "
                                      "must be a dict with 'role' and 'content'", "messages")
    if tokenizer.chat_template is None and chat_template is None:
        raise InvalidRequestError("this model's tokenizer has no chat template; pass "
                                  "chat_template=... or use a plain prompt", "messages")
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template)
    except (TemplateError, ValueError) as e:  # what the template refuses: the input's
        raise InvalidRequestError(f"messages: the chat template cannot render them: {e}",
                                  "messages") from None


__all__ = ["render_chat"]
