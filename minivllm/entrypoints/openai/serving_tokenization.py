"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's endpoints, same fields).

``/tokenize`` takes a ``prompt`` (text) or chat ``messages`` (rendered with the
chat template first, as a chat request would be) and returns the token IDs;
``/detokenize`` turns token IDs back into text.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field, StrictBool, StrictInt

from minivllm.entrypoints.openai.protocol.chat import check_messages
from minivllm.entrypoints.openai.protocol import (BadRequestError, ChatMessage, RequestModel,
                                                  ResponseModel)


class TokenizeRequest(RequestModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    # A chat template cannot render an empty conversation (as the chat endpoint says).
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    # The schema says what tokenize() enforces: exactly one of the two.
    model_config = RequestModel.model_config | {"json_schema_extra": {"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]}}


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(RequestModel):
    model: Optional[str] = None
    tokens: list[StrictInt] = Field(min_length=0)


class DetokenizeResponse(ResponseModel):
    prompt: str


def tokenize(engine, body: TokenizeRequest) -> TokenizeResponse:
    tok = engine.tokenizer
    if tok is None:
        raise BadRequestError("this model has no tokenizer", "prompt")
    if (body.prompt is None) == (body.messages is None):
        raise BadRequestError("give exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        check_messages(body.messages)
        text = engine.input_processor.render_chat(  # as the engine renders a chat prompt
            [m.to_template_dict() for m in body.messages], body.add_generation_prompt)
        ids = tok.encode(text, add_special_tokens=False)  # the template placed them
    else:
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                            token_strs=tok.convert_ids_to_tokens(ids)
                            if body.return_token_strs else None)


def detokenize(engine, body: DetokenizeRequest) -> DetokenizeResponse:
    tok = engine.tokenizer
    vocab = engine.config.model.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise BadRequestError(f"tokens contains {bad[:5]}: token IDs must be in [0, {vocab})",
                              "tokens")
    return DetokenizeResponse(prompt=tok.decode(body.tokens))
