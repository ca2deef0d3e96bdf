"""The model a simulation is about: its ``config.json`` alone, no weights.

``--model`` takes a built-in preset (config files written from the published
Hugging Face configs of the models), a model folder, or a ``config.json``
path. Only the architecture numbers matter: sizes of the matrices, heads,
layers, vocabulary. ``deepseek-v3`` and ``qwen3-next-80b-a3b`` have attention the
cost model does not price as such (MLA, linear layers): ``load_raw_config`` reads them
for ``kv_specs`` (their KV capacity by group); ``load_model_config`` reads their experts
as the engine does (DeepSeek-V3: 58 sparse layers of 256 experts, top-8, one shared
expert; its attention priced as plain heads, 4.5% above the published active count).
"""

from __future__ import annotations

from pathlib import Path

from minivllm.config import ModelConfig

PRESET_DIR = Path(__file__).parent / "models"
MODEL_PRESETS = ("llama-3-8b", "llama-3-70b", "qwen3-8b", "smollm2-135m", "gemma-3-27b",
                 "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "qwen3-next-80b-a3b")


def model_folder(spec: str) -> Path:
    if spec in MODEL_PRESETS:
        return PRESET_DIR / spec
    path = Path(spec)
    if path.is_file() and path.name == "config.json":
        return path.parent
    if (path / "config.json").is_file():
        return path
    raise ValueError(f"model={spec!r} is invalid: give a preset ({', '.join(MODEL_PRESETS)}), "
                     "a model folder with a config.json, or the path of a config.json")


def load_raw_config(spec: str) -> dict:
    """The ``config.json`` of a preset, folder or path, as a dict."""
    import json

    return json.loads((model_folder(spec) / "config.json").read_text())


def load_model_config(spec: str, dtype: str = "auto", device: str = "cuda",
                      quantization: str = "auto") -> ModelConfig:
    """The ``ModelConfig`` the real engine would build, in the dtype it would run in
    and with the weights it would keep (a folder converted from a GGUF file: its
    quantized blocks, as ``LLM`` resolves ``quantization``)."""
    from minivllm.config.quantization import quantized_model_config

    model = ModelConfig.from_pretrained(model_folder(spec), dtype, device)
    return quantized_model_config(model, quantization, dtype)


__all__ = ["MODEL_PRESETS", "load_model_config", "load_raw_config", "model_folder"]
