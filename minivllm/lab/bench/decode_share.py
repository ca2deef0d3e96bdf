"""Where one stream's decode token goes: the step's C++ replay, and the Python
around it, against the memory-bandwidth bound measured in the same process.

``python -m minivllm.lab.bench.decode_share [--activation-dtype int8]``

A single stream is bandwidth-bound: at best a token costs the bytes of the
weights over the memory's bandwidth (``roofline.py``). This splits the
measured time of a token in two: the decode-step replay
(``cpu/fused_decode.py``, one C++ call that reads every weight once), and
everything else the engine does per token in Python (scheduling, the
sampler, detokenizing). Each round measures the bandwidth first and then
generates, so both shares are of the same moment's bound; a burst of outside
load spoils a round, not the comparison inside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Union

from minivllm.lab.bench.roofline import measure_bandwidth
from minivllm.lab.bench.throughput.backend_process import model_weight_bytes
from minivllm.sampling_params import SamplingParams

PROMPT = "Write a short story about a robot learning to paint."


@dataclass
class DecodeShare:
    bandwidth: float  # bytes/s, the probe's best of this round
    weight_bytes: int  # what one step reads
    num_tokens: int  # tokens generated, the first (prefill) included
    seconds: float  # the whole generate call
    replay_seconds: list[float]  # one entry per replayed decode step

    @property
    def roofline_s(self) -> float:
        """A token at the probe's bandwidth: the weights read once."""
        return self.weight_bytes / self.bandwidth

    @property
    def token_s(self) -> float:
        return self.seconds / self.num_tokens

    @property
    def replay_s(self) -> float:
        return statistics.median(self.replay_seconds)

    @property
    def outside_replay_s(self) -> float:
        """Per token, what the engine spent outside the replay (prefill included)."""
        return (self.seconds - sum(self.replay_seconds)) / self.num_tokens

    def line(self) -> str:
        roof = self.roofline_s
        return (f"probe {self.bandwidth / 1e9:.1f} GB/s, roofline {roof * 1e3:.2f} ms/token "
                f"({self.weight_bytes / 1e6:.1f} MB); replay {self.replay_s * 1e3:.2f} ms "
                f"= {roof / self.replay_s:.0%} of it; whole token {self.token_s * 1e3:.2f} ms "
                f"= {roof / self.token_s:.0%}; outside the replay "
                f"{self.outside_replay_s * 1e3:.2f} ms/token")


@contextmanager
def timed_replay(llm) -> Iterator[list[float]]:
    """Record the seconds of each decode-step replay ``llm`` runs inside the block."""
    runner = llm.engine_core.executor.runner
    replay = runner.decode_replay
    if replay is None:
        raise RuntimeError(f"this engine replays no decode step: "
                           f"{runner.decode_replay_problem}")
    seconds: list[float] = []
    run = replay._run

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = run(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return out

    replay._run = timed  # an instance attribute: the class's method is untouched
    try:
        yield seconds
    finally:
        del replay._run


def measure(llm, max_tokens: int = 128, probe_seconds: float = 0.5,
            prompt: Union[str, list[int]] = PROMPT) -> DecodeShare:
    """One round: the bandwidth probe, then one greedy stream of ``max_tokens``."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    bandwidth = measure_bandwidth(min_seconds=probe_seconds).best
    with timed_replay(llm) as replay_seconds:
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    return DecodeShare(bandwidth, model_weight_bytes(llm), max_tokens, seconds,
                       list(replay_seconds))


def main(argv: Optional[list[str]] = None) -> list[DecodeShare]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF or HF model (default: SmolLM2)")
    parser.add_argument("--activation-dtype", default=None, choices=["int8"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    from minivllm.entrypoints.llm import LLM

    kwargs = {"activation_dtype": args.activation_dtype} if args.activation_dtype else {}
    if args.model:
        kwargs["model"] = args.model
    llm = LLM(**kwargs)
    llm.generate([PROMPT], SamplingParams(max_tokens=8), use_tqdm=False)  # warm up
    rounds = []
    for i in range(args.rounds):
        rounds.append(measure(llm, args.max_tokens))
        print(f"round {i}: {rounds[-1].line()}", flush=True)
    return rounds


if __name__ == "__main__":
    main()
