"""bench_args: a benchmark's command-line defaults, built from Python."""

import argparse

import pytest

from minivllm.lab.bench import attention, serve
from minivllm.lab.bench.args import bench_args


@pytest.mark.parametrize("module", [attention, serve])
def test_bench_args_equals_the_command_line(module):
    parser = argparse.ArgumentParser()
    module.add_cli_args(parser)
    assert bench_args(module.add_cli_args) == parser.parse_args([])
    cli = parser.parse_args(["--block-size", "8"] if module is attention
                            else ["--num-prompts", "7"])
    name = "block_size" if module is attention else "num_prompts"
    assert bench_args(module.add_cli_args, **{name: getattr(cli, name)}) == cli


def test_bench_args_names_an_unknown_option():
    with pytest.raises(ValueError, match="num_prompt is not an option.*num_prompts"):
        bench_args(serve.add_cli_args, num_prompt=3)
