"""Pooling: embeddings and scores from a decoder model's final hidden states.

Loaded only when a pooling request (``LLM.embed``, ``LLM.score``, ``LLM.classify``,
``/v1/embeddings``, ``/v1/score``, ``/v1/rerank``) or a ``*ForSequenceClassification``
checkpoint asks for it; the generation path never imports it.

- ``model_info.py``  how the served model pools (last token or mean), its score head
- ``params.py``      a pooling request as the engine carries it (prefill only)
- ``pooler.py``      the worker side: hidden rows -> one vector per request, over chunks
- ``runner.py``      the model runner's pooling step
- ``classifier.py``  ``LlamaForSequenceClassification`` / ``Qwen3ForSequenceClassification``
- ``outputs.py``     ``EmbeddingRequestOutput``, ``ScoringRequestOutput``, ...
- ``offline.py``     ``LLM.embed`` / ``score`` / ``classify``
"""
