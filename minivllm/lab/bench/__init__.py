"""Benchmarks behind `minivllm bench ...`: each module has add_cli_args(parser) and run(args)."""
