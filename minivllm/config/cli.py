"""``EngineArgs`` on the command line: one ``--kebab-case`` flag per field.

The flags have the fields' names (vLLM's engine arguments); a dict field takes
a JSON object. Imported by ``minivllm serve/generate/chat`` only.
"""

from __future__ import annotations

import argparse
import json
import typing
from dataclasses import fields

from minivllm.config.engine import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    """One flag per ``EngineArgs`` field, typed from its annotation."""
    group = parser.add_argument_group("engine arguments")
    hints = typing.get_type_hints(EngineArgs)
    for f in fields(EngineArgs):
        if f.name == "model" and not with_model:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        base = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
        if base[0] is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction,
                               default=f.default)
        elif base[0] is dict or typing.get_origin(base[0]) is dict:
            group.add_argument(flag, type=json_dict(f.name), default=f.default,
                               metavar="JSON", help=_DICT_HELP.get(f.name))
        else:
            group.add_argument(flag, type=base[0], default=f.default,
                               metavar=f.name.upper())


_DICT_HELP = {
    "kv_events_config": "publish the prefix cache's changes (vLLM's dict as JSON), e.g. "
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
                        '"endpoint": "tcp://*:5557"}\'',
    "speculative_config": "speculative decoding, vLLM's dict as JSON, e.g. "
                          '\'{"method": "ngram", "num_speculative_tokens": 3}\' or '
                          '\'{"method": "draft_model", "model": PATH, '
                          '"num_speculative_tokens": 3}\'',
    "kv_transfer_config": "a KV connector, vLLM's dict as JSON, e.g. "
                          '\'{"kv_connector": "P2pConnector", "kv_role": "kv_producer"}\'',
    "eplb_config": "the experts' load balancer (with --enable-eplb), vLLM's dict as JSON, "
                   'e.g. \'{"num_redundant_experts": 2, "window_size": 1000, '
                   '"step_interval": 100}\'',
    "weight_transfer_config": "let a trainer process send new weights (vLLM's dict as "
                              'JSON): \'{"backend": "gloo"}\'; the server\'s routes need '
                              "MINIVLLM_SERVER_DEV_MODE=1",
}


def json_dict(name: str):
    """An argparse type: a JSON object, or an error naming the flag."""
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--{name.replace('_', '-')}={text!r} is not "
                                             f"valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"--{name.replace('_', '-')}={text!r} is "
                                             "invalid: must be a JSON object")
        return value
    return parse



__all__ = ["add_engine_args", "json_dict"]
