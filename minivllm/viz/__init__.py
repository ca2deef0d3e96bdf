"""Plotly figure builders for the book: one concept per module.

The chapters call these and never build figures inline, so every figure's
logic is unit-tested through ``fig.data`` / ``fig.layout`` (tests/test_viz*.py).
Import from the module that owns the concept::

    from minivllm.viz.timeline import request_timeline     # a request's life
    from minivllm.viz.tokens import token_boundaries       # token pieces, coloured
    from minivllm.viz.heatmap import attention_heatmap     # who attends to whom
    from minivllm.viz.bars import topk_bars, lines         # probabilities, trends
    from minivllm.viz.blocks import block_map_figure       # the paged KV cache, per step
    from minivllm.viz.gantt import gantt_figure            # who ran at which engine step
    from minivllm.viz.kernel import tile_visit_figure      # the Triton kernel's tiles
    from minivllm.viz.prefix import hash_chain_figure      # prefix caching: the hash chain
    from minivllm.viz.sampling import filter_figure        # sampling knobs on a distribution
    from minivllm.viz.stream import stream_figure          # tokens vs stream events
    from minivllm.viz.latency import batch_tradeoff_figure # throughput vs latency
    from minivllm.viz.sequence import sequence_figure      # API side <-> engine core messages
    from minivllm.viz.parallel import weight_split_figure  # tensor parallelism: shards, bytes
    from minivllm.viz.export import save_key_figure        # `make figures`

plotly is an optional dependency (``pip install minivllm[book]``): importing
this package needs nothing, importing a builder module needs plotly.
"""
