"""Structured outputs: the output constrained to a language, one token mask per step.

    StructuredOutputsParams (json | regex | choice | grammar | json_object)
        │  grammar_spec.py   checked by the input processor, on the API side (a bad
        │                    spec is a 400 naming the field)
        ▼
    compiler.py      compiled once per spec against the vocabulary (xgrammar), cached
        ▼
    request_grammar.py   one matcher per request: its state after the tokens accepted so far
        ▼
    bitmask.py       each step: which next tokens keep the output valid, as bits; -inf elsewhere
        ▼
    manager.py       the model runner's hook: mask the constrained rows of a mixed batch,
                     advance each grammar by its sampled token, release on finish/abort/preempt
"""

from minivllm.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
