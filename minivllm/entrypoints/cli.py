"""``minivllm`` command line: generate, chat, serve, bench.

    minivllm generate "What is the capital of France?" --chat
    minivllm chat
    minivllm serve [MODEL] --port 8000
    minivllm bench {throughput,serve,roofline,attention,structured,spec-decode} ...
    minivllm simulate --model llama-3-8b --hardware h100-sxm ...
    minivllm simulate {calibrate,validate,published} ...
    minivllm disagg-proxy --prefill URL --decode URL --port N
    minivllm router --replica URL --replica URL --policy kv_aware --kv-events ... --port N

Every engine argument is a ``--kebab-case`` flag (``--max-num-seqs 64``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from typing import Optional

from minivllm.config import EngineArgs

BENCHMARKS = {
    "throughput": "minivllm.lab.bench.throughput",
    "serve": "minivllm.lab.bench.serve",
    "roofline": "minivllm.lab.bench.roofline",
    "attention": "minivllm.lab.bench.attention",
    "spec-decode": "minivllm.lab.bench.spec_decode",
    "structured": "minivllm.lab.bench.structured",
    "kv-offload": "minivllm.lab.bench.kv_offload",
    "disagg": "minivllm.lab.bench.disagg",
}


# `minivllm simulate [SUBCOMMAND]`, by module name as the benchmarks are: the
# simulator is a tool on top of the engine (it runs LLM and serve), not below the CLI.
SIMULATE = {
    None: "minivllm.lab.sim.cli",
    "calibrate": "minivllm.lab.sim.calibrate",
    "validate": "minivllm.lab.sim.validate",
    "published": "minivllm.lab.sim.published",
}


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

    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(ns)))
    prompt = [{"role": "user", "content": ns.prompt}] if ns.chat else ns.prompt
    _stream(llm, prompt, sampling_params_from(ns))
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from minivllm.entrypoints.llm import LLM

    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(ns)))
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
    importlib.import_module(SIMULATE[ns.sim_command]).run(ns)
    return 0


def cmd_disagg_proxy(ns: argparse.Namespace) -> int:
    from minivllm.entrypoints.router import disagg_proxy

    return disagg_proxy.run(ns) or 0
def cmd_router(ns: argparse.Namespace) -> int:
    from minivllm.entrypoints.router.router import run_router

    return run_router(ns)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the chat template")
    EngineArgs.add_cli_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="multi-turn chat in the terminal")
    chat.add_argument("--system", default=None, help="a system prompt")
    EngineArgs.add_cli_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible server with a demo page")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL")
    try:
        from minivllm.entrypoints.openai.api_server import add_server_args

        add_server_args(serve)
    except ImportError:  # server extras not installed
        pass
    EngineArgs.add_cli_args(serve)
    serve.set_defaults(func=cmd_serve)

    router = sub.add_parser("router", help="one OpenAI endpoint over several serve replicas")
    from minivllm.entrypoints.router.router import add_cli_args as add_router_args

    add_router_args(router)
    router.set_defaults(func=cmd_router)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHMARKS.items():
        p = bsub.add_parser(name)
        try:
            importlib.import_module(module_name).add_cli_args(p)
        except ImportError as e:
            p.set_defaults(_unavailable=str(e))
        p.set_defaults(func=cmd_bench)

    sim = sub.add_parser("simulate", help="the real scheduler on simulated hardware")
    importlib.import_module(SIMULATE[None]).add_cli_args(sim)
    ssub = sim.add_subparsers(dest="sim_command")
    for name, module_name in SIMULATE.items():
        if name is None:
            continue
        module = importlib.import_module(module_name)
        kwargs = {} if name == "calibrate" else {
            "description": module.__doc__,
            "formatter_class": argparse.RawDescriptionHelpFormatter}
        module.add_cli_args(ssub.add_parser(name, help=module.__doc__.split("\n")[0],
                                            **kwargs))
    sim.set_defaults(func=cmd_simulate)

    from minivllm.entrypoints.router import disagg_proxy

    proxy = sub.add_parser("disagg-proxy", help="prefill on one server, decode on another",
                           description=disagg_proxy.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    disagg_proxy.add_cli_args(proxy)
    proxy.set_defaults(func=cmd_disagg_proxy)
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
