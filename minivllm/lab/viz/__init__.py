"""Plotly figure builders for the book: one concept per module.

The chapters call these and never build figures inline, so every figure's
logic is unit-tested through ``fig.data`` / ``fig.layout`` (tests/test_viz*.py).
Import from the module that owns the concept::

    from minivllm.lab.viz.timeline import request_timeline     # a request's life
    from minivllm.lab.viz.tokens import token_boundaries       # token pieces, coloured
    from minivllm.lab.viz.heatmap import attention_heatmap     # who attends to whom
    from minivllm.lab.viz.bars import topk_bars, lines         # probabilities, trends
    from minivllm.lab.viz.blocks import block_map_figure       # the paged KV cache, per step
    from minivllm.lab.viz.gantt import gantt_figure            # who ran at which engine step
    from minivllm.lab.viz.kernel import tile_visit_figure      # the Triton kernel's tiles
    from minivllm.lab.viz.prefix import hash_chain_figure      # prefix caching: the hash chain
    from minivllm.lab.viz.sampling import filter_figure        # sampling knobs on a distribution
    from minivllm.lab.viz.stream import stream_figure          # tokens vs stream events
    from minivllm.lab.viz.latency import batch_tradeoff_figure # throughput vs latency
    from minivllm.lab.viz.sequence import sequence_figure      # API side <-> engine core messages
    from minivllm.lab.viz.parallel import weight_split_figure  # tensor parallelism: shards, bytes
    from minivllm.lab.viz.export import save_key_figure        # `make figures`

The plumbing a chapter needs stays out of its cells too, in tested helpers:
``minivllm.lab.viz.source.show_source`` / ``show_csrc`` (short slices of the engine's
Python and C++ taken at run time, never a pasted copy), ``minivllm.lab.viz.notes.timing_note``
(the one boxed note on what measured times are worth), ``minivllm.lab.bench.args.bench_args``
(a benchmark's command-line defaults plus overrides) and
``minivllm.entrypoints.launch.process_gone`` / ``port_is_free`` (a stopped server left no
process and no listener behind).

plotly is an optional dependency (``pip install minivllm[book]``): importing
this package needs nothing, importing a builder module needs plotly.
"""
