"""``minivllm`` command line: generate, chat, serve, bench.

    minivllm generate "What is the capital of France?" --chat
    minivllm chat
    minivllm serve [MODEL] --port 8000
    minivllm bench {throughput,serve,roofline,attention,structured,spec-decode} ...
    minivllm simulate --model llama-3-8b --hardware h100-sxm ...
    minivllm simulate {calibrate,validate,published} ...

Every engine argument is a ``--kebab-case`` flag (``--max-num-seqs 64``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import typing
from typing import Optional

from minivllm.config import EngineArgs

BENCHMARKS = {
    "throughput": "minivllm.benchmarks.throughput",
    "serve": "minivllm.benchmarks.serve",
    "roofline": "minivllm.benchmarks.roofline",
    "attention": "minivllm.benchmarks.attention",
    "spec-decode": "minivllm.benchmarks.spec_decode",
    "structured": "minivllm.benchmarks.structured",
}


def add_engine_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    """One flag per ``EngineArgs`` field, typed from its annotation."""
    group = parser.add_argument_group("engine arguments")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model" and not with_model:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        base = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
        if base[0] is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif base[0] is dict or typing.get_origin(base[0]) is dict:
            group.add_argument(flag, type=json_dict(f.name), default=f.default, metavar="JSON",
                               help=DICT_HELP.get(f.name))
        else:
            group.add_argument(flag, type=base[0], default=f.default, metavar=f.name.upper())


DICT_HELP = {
    "speculative_config": "speculative decoding, vLLM's dict as JSON, e.g. "
                          '\'{"method": "ngram", "num_speculative_tokens": 3}\' or '
                          '\'{"method": "draft_model", "model": PATH, '
                          '"num_speculative_tokens": 3}\'',
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


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    # --seed is the engine's; this one seeds each request's sampling.
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)


def sampling_params_from(ns: argparse.Namespace):
    from minivllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                          top_p=ns.top_p, top_k=ns.top_k, seed=ns.sampling_seed,
                          stop=ns.stop)


def _stream(llm, prompt, params) -> str:
    text = ""
    for out in llm.stream(prompt, params):
        delta = out.outputs[0].text
        text += delta
        print(delta, end="", flush=True)
    print()
    return text


def cmd_generate(ns: argparse.Namespace) -> int:
    from minivllm.entrypoints.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    prompt = [{"role": "user", "content": ns.prompt}] if ns.chat else ns.prompt
    _stream(llm, prompt, sampling_params_from(ns))
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from minivllm.entrypoints.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    params = sampling_params_from(ns)
    messages = [{"role": "system", "content": ns.system}] if ns.system else []
    print("minivllm chat — an empty line or Ctrl-D quits.")
    while True:
        try:
            user = input("you> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        print("assistant> ", end="", flush=True)
        messages.append({"role": "assistant", "content": _stream(llm, messages, params)})
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from minivllm.entrypoints.openai.api_server import run_server

    return run_server(ns) or 0


def cmd_bench(ns: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHMARKS[ns.bench])
    result = module.run(ns)
    # A load test whose requests failed measured nothing: say so in the exit status.
    return 1 if getattr(result, "failed", 0) else 0


def cmd_simulate(ns: argparse.Namespace) -> int:
    if ns.sim_command == "calibrate":
        from minivllm.sim import calibrate

        calibrate.run(ns)
    elif ns.sim_command in ("validate", "published"):
        importlib.import_module(f"minivllm.sim.{ns.sim_command}").run(ns)
    else:
        from minivllm.sim import cli as sim_cli

        sim_cli.run(ns)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the chat template")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="multi-turn chat in the terminal")
    chat.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible server with a demo page")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL")
    try:
        from minivllm.entrypoints.openai.api_server import add_server_args

        add_server_args(serve)
    except ImportError:  # server extras not installed
        pass
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHMARKS.items():
        p = bsub.add_parser(name)
        try:
            importlib.import_module(module_name).add_cli_args(p)
        except ImportError as e:
            p.set_defaults(_unavailable=str(e))
        p.set_defaults(func=cmd_bench)

    from minivllm.sim import calibrate, cli as sim_cli, published, validate

    sim = sub.add_parser("simulate", help="the real scheduler on simulated hardware")
    sim_cli.add_cli_args(sim)
    ssub = sim.add_subparsers(dest="sim_command")
    calibrate.add_cli_args(ssub.add_parser("calibrate", help=calibrate.__doc__.split("\n")[0]))
    validate.add_cli_args(ssub.add_parser(
        "validate", help=validate.__doc__.split("\n")[0], description=validate.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    published.add_cli_args(ssub.add_parser(
        "published", help=published.__doc__.split("\n")[0], description=published.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    sim.set_defaults(func=cmd_simulate)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    ns = build_parser().parse_args(argv)
    if getattr(ns, "_unavailable", None):
        print(f"this benchmark is unavailable: {ns._unavailable}", file=sys.stderr)
        return 2
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
