"""The models a server answers to: the base model and its LoRA adapters (vLLM's
``OpenAIServingModels``).

A request's ``"model"`` picks one: the served model name is the base model, an
adapter's name runs that adapter, anything else is a 404 (as OpenAI answers
for an unknown model). ``--lora-modules`` names the adapters at start-up
(``name=path``, or JSON ``{"name", "path", "base_model_name"}``);
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change the list
while serving, only when ``MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set.
"""

from __future__ import annotations

import json
from typing import Optional

from minivllm import envs

from pydantic import BaseModel

from minivllm.entrypoints.openai.protocol import BadRequestError, ModelCard
from minivllm.entrypoints.openai.serving_engine import ModelNotFoundError
from minivllm.inputs.request_checks import lora_checker
from minivllm.lora.request import LoRARequest



def runtime_lora_updating_allowed() -> bool:
    return envs.MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING


def parse_lora_modules(values: Optional[list[str]]) -> list[tuple[str, str, Optional[str]]]:
    """``--lora-modules`` values -> (name, path, base_model_name)."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                raw = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {value!r} is not valid JSON ({e})") from None
            if not isinstance(raw, dict) or not raw.get("name") or not raw.get("path"):
                raise ValueError(f"--lora-modules {value!r} is invalid: the JSON form needs "
                                 '{"name": ..., "path": ...} (and optionally '
                                 '"base_model_name")')
            modules.append((raw["name"], raw["path"], raw.get("base_model_name")))
        elif "=" in value and value.split("=", 1)[0] and value.split("=", 1)[1]:
            name, path = value.split("=", 1)
            modules.append((name, path, None))
        else:
            raise ValueError(f"--lora-modules {value!r} is invalid: expected name=path or "
                             'JSON {"name": ..., "path": ...}')
    return modules


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: Optional[int] = None


class OpenAIServingModels:
    def __init__(self, engine, model_name: str,
                 lora_modules: Optional[list[str]] = None) -> None:
        self.engine, self.model_name = engine, model_name
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_id = 1
        modules = parse_lora_modules(lora_modules)
        if modules and engine.config.lora is None:
            raise ValueError("--lora-modules needs --enable-lora")
        for name, path, base in modules:  # each checked now: a bad one stops start-up
            self.add(name, path, base)

    def resolve(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's "model" names; None for the base model."""
        if model is None or model == self.model_name:
            return None
        if model in self.lora_requests:
            return self.lora_requests[model]
        raise ModelNotFoundError(model, [self.model_name, *self.lora_requests])

    def cards(self) -> list[ModelCard]:
        engine = self.engine
        base = ModelCard(id=self.model_name, root=engine.config.model.path,
                         max_model_len=engine.max_model_len)
        return [base] + [ModelCard(id=name, root=lora.lora_path,
                                   parent=lora.base_model_name or self.model_name,
                                   max_model_len=engine.max_model_len)
                         for name, lora in self.lora_requests.items()]

    def add(self, name: str, path: str, base_model_name: Optional[str] = None) -> LoRARequest:
        if name == self.model_name or name in self.lora_requests:
            raise BadRequestError(f"lora_name={name!r} is already served: choose another "
                                  "name (or unload that adapter first)", "lora_name")
        if base_model_name not in (None, self.model_name):
            raise BadRequestError(f"base_model_name={base_model_name!r} is not served here: "
                                  f"it must be {self.model_name!r}", "base_model_name")
        lora = LoRARequest(name, self._next_id, path, base_model_name)
        try:
            lora_checker(self.engine.input_processor).check(lora)
        except ValueError as e:
            raise BadRequestError(str(e), "lora_path") from None
        # Ids are never reused: an unloaded adapter's id can still name cached blocks.
        self._next_id += 1
        self.lora_requests[name] = lora
        return lora

    def remove(self, name: str) -> None:
        lora = self.lora_requests.pop(name, None)
        if lora is None:
            raise ModelNotFoundError(name, list(self.lora_requests), what="LoRA adapter")
        lora_checker(self.engine.input_processor).forget(lora.lora_int_id)


__all__ = ["OpenAIServingModels", "LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest", "parse_lora_modules",
           "runtime_lora_updating_allowed"]
