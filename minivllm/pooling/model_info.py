"""How the served model pools, read once from its folder (the same answer in the API
process, which checks requests, and in the worker, which pools).

vLLM's choice for a decoder model: the last token's final hidden state (``LAST``),
unless the folder is a sentence-transformers model whose ``1_Pooling/config.json``
asks for the mean of all tokens (``MEAN``) or another supported mode. Embeddings are
normalised to unit length by default. A ``*ForSequenceClassification`` checkpoint pools
the last token and applies its ``score`` head (``num_labels`` outputs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

CLASSIFICATION_SUFFIX = "ForSequenceClassification"
# sentence-transformers' pooling modes -> vLLM's pooling types (the ones minivllm has)
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN"}


@dataclass(frozen=True)
class PoolerInfo:
    pooling_type: str  # "LAST" | "MEAN"
    hidden_size: int
    num_labels: Optional[int]  # a classification head's outputs; None: an embedding model
    # Matryoshka: the embedding may be cut to ``dimensions`` (None: any up to hidden_size).
    matryoshka: bool
    matryoshka_dimensions: Optional[tuple[int, ...]]

    @property
    def is_classifier(self) -> bool:
        return self.num_labels is not None


def is_classification_checkpoint(hf_config: dict) -> bool:
    return any(a.endswith(CLASSIFICATION_SUFFIX) for a in hf_config.get("architectures") or [])


def _sentence_transformers_pooling(path: Path) -> Optional[str]:
    cfg = path / "1_Pooling" / "config.json"
    if not cfg.is_file():
        return None
    modes = json.loads(cfg.read_text())
    chosen = [kind for key, kind in _ST_MODES.items() if modes.get(key)]
    others = [k for k, v in modes.items() if k.startswith("pooling_mode") and v
              and k not in _ST_MODES]
    if others or len(chosen) != 1:
        raise ValueError(f"{cfg} asks for pooling {others or chosen}: minivllm pools by "
                         "the last token or the mean (one of them)")
    return chosen[0]


@lru_cache(maxsize=8)
def pooler_info_for(path: str, hf_config_json: str) -> PoolerInfo:
    hf = json.loads(hf_config_json)
    classifier = is_classification_checkpoint(hf)
    num_labels = None
    if classifier:
        num_labels = int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 2)
    dims = hf.get("matryoshka_dimensions")
    return PoolerInfo(
        pooling_type="LAST" if classifier else (_sentence_transformers_pooling(Path(path))
                                                or "LAST"),
        hidden_size=int(hf["hidden_size"]), num_labels=num_labels,
        matryoshka=bool(hf.get("is_matryoshka") or dims),
        matryoshka_dimensions=tuple(dims) if dims else None)


def pooler_info(model_config) -> PoolerInfo:
    """The ``PoolerInfo`` of a ``ModelConfig``."""
    return pooler_info_for(model_config.path, json.dumps(model_config.hf_config, sort_keys=True))


__all__ = ["PoolerInfo", "pooler_info", "is_classification_checkpoint", "CLASSIFICATION_SUFFIX"]
