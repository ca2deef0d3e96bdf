"""Benchmark arguments from Python: a module's command-line defaults plus overrides.

Every benchmark module takes its settings as the ``argparse.Namespace`` its
``add_cli_args`` parser produces. A notebook or a test that calls ``run(args)``
directly should get exactly those defaults, not a hand-written copy that drifts
when an option is added::

    args = bench_args(attention.add_cli_args, shapes="all", iters=1)
"""

from __future__ import annotations

import argparse
from typing import Any, Callable


def bench_args(add_cli_args: Callable[[argparse.ArgumentParser], None],
               **overrides: Any) -> argparse.Namespace:
    """The parser's defaults, with ``overrides`` (Python names: ``num_prompts``)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(parser)
    args = parser.parse_args([])
    unknown = sorted(set(overrides) - set(vars(args)))
    if unknown:
        raise ValueError(f"bench_args: {', '.join(unknown)} is not an option of this "
                         f"benchmark; allowed: {', '.join(sorted(vars(args)))}")
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


__all__ = ["bench_args"]
