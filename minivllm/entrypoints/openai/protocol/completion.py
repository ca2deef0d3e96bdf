"""``/v1/completions``: the request, the response and its chunks."""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field, StrictBool, StrictInt

from minivllm.entrypoints.openai.protocol.common import (MAX_N, BadRequestError, ResponseModel,
                                                         SamplingRequest, UsageInfo)

class CompletionRequest(SamplingRequest):
    # One prompt (text or token IDs) or a batch of them.
    # (An empty text has no token: the schema says so, the engine's 400 explains.)
    prompt: Union[Annotated[str, Field(json_schema_extra={"minLength": 1})],
                  Annotated[list[Annotated[str, Field(json_schema_extra={"minLength": 1})]],
                            Field(min_length=1)],
                  Annotated[list[StrictInt], Field(min_length=1)],
                  Annotated[list[Annotated[list[StrictInt], Field(min_length=1)]],
                            Field(min_length=1)]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    # The prompt in front of the completion (text, and logprobs when asked):
    # how clients score a text (lm-eval's loglikelihood) with max_tokens 0 or 1.
    echo: StrictBool = False
    max_tokens: Optional[int] = Field(None, ge=0)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    # OpenAI documents it; it needs a model trained to fill in the middle.
    suffix: Optional[str] = Field(None, json_schema_extra={"maxLength": 0})  # (check's 400)
    # vLLM's beam search: n beams, best first (entrypoints/beam_search.py).
    use_beam_search: StrictBool = False
    length_penalty: float = Field(1.0, ge=-10, le=10)

    def num_logprobs(self) -> Optional[int]:
        return self.logprobs

    def num_prompt_logprobs(self) -> Optional[int]:
        return self.logprobs if self.echo else None

    def requested_max_tokens(self) -> Optional[int]:
        # Echo only: generate one token and drop it (the engine always samples one).
        return 1 if self.echo_only else self.max_tokens

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def check(self) -> None:
        super().check()
        if self.use_beam_search:
            self._check_beam_search()
        if self.suffix:
            raise BadRequestError("suffix is not supported: this model does not fill in "
                                  "the middle", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequestError(f"best_of={self.best_of} is not supported: it must equal "
                                  f"n ({self.n})", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise BadRequestError("max_tokens=0 is only allowed with echo=true (it returns "
                                  "the prompt); otherwise it must be >= 1", "max_tokens")
        if isinstance(self.prompt, list) and not self.prompt:
            raise BadRequestError("prompt is empty: give a string, a list of token IDs, or "
                                  "a non-empty batch of them", "prompt")

    def _check_beam_search(self) -> None:
        for name, bad, allowed in (("n", not 1 <= self.n <= 10, "the beam width: in [1, 10]"),
                                   ("stream", self.stream, "false with use_beam_search"),
                                   ("echo", self.echo, "false with use_beam_search"),
                                   ("logprobs", self.logprobs is not None,
                                    "null with use_beam_search")):
            if bad:
                raise BadRequestError(f"{name}={getattr(self, name)!r} is invalid: must be "
                                      f"{allowed}", name)

    def prompts(self) -> list[Union[str, list[int]]]:
        """The batch of prompts (a single prompt is a batch of one)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
