"""``*ForSequenceClassification``: a decoder whose language-model head is replaced by a
``score`` head, one output per label, read at the last token (Hugging Face's
``LlamaForSequenceClassification``, ``Qwen3ForSequenceClassification``; rerankers and
reward models ship this way). The body is the family's own model; only the head differs.
"""

from __future__ import annotations

from functools import lru_cache

from torch import nn


@lru_cache(maxsize=None)
def with_score_head(causal_lm: type) -> type:
    """``causal_lm``'s class with a ``score`` head in place of ``lm_head``."""

    class ForSequenceClassification(causal_lm):
        def __init__(self, cfg, backend) -> None:
            super().__init__(cfg, backend)
            del self.lm_head  # no vocabulary: this model scores, it does not generate
            hf = cfg.hf_config
            num_labels = int(hf.get("num_labels") or len(hf.get("id2label") or {}) or 2)
            self.score = nn.Linear(cfg.hidden_size, num_labels, bias=False, dtype=cfg.dtype)

        def compute_logits(self, hidden):
            raise ValueError(f"{self.config.hf_config['architectures'][0]} has no language "
                             "model head: use it through LLM.score / LLM.classify, "
                             "/v1/score or /v1/rerank")

    ForSequenceClassification.__name__ = causal_lm.__name__.replace(
        "ForCausalLM", "ForSequenceClassification")
    return ForSequenceClassification


__all__ = ["with_score_head"]
