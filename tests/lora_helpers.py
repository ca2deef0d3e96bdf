"""Build PEFT adapters for tests and the references they are checked against."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Different ranks, alphas and target modules (one with rsLoRA).
ADAPTER_SPECS = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=ALL_MODULES),
    "qv-r4-rslora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                         use_rslora=True),
    "mlp-o-r16": dict(r=16, lora_alpha=24, target_modules=["o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]),
}


def build_peft_adapter(base: str | Path, folder: Path, seed: int, **lora_kwargs) -> Path:
    """A random adapter with non-zero lora_B, saved by PEFT itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(hf, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0,
                                          **lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # big enough to change the greedy tokens
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    model.save_pretrained(folder)
    return folder


def peft_model(base: str | Path, adapter: Path | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return hf if adapter is None else PeftModel.from_pretrained(hf, adapter).eval()


@torch.inference_mode()
def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by full forward passes (no generation config involved)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]
