"""``LLM``'s RL and pooling methods are real methods (``help(LLM)`` and IDEs list them),
each taking exactly what the implementation it calls takes, with the same defaults."""

import inspect

import pytest

from minivllm import LLM
from minivllm.core.rollout import LLM_API, RolloutControl
from minivllm.pooling import offline


def _params(fn) -> list[tuple[str, object]]:
    """(name, default) of every parameter after the first (self, or the llm)."""
    return [(p.name, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]]


@pytest.mark.parametrize("name", LLM_API)
def test_each_rl_call_is_a_method_of_llm_with_the_controls_parameters(name):
    assert name in dir(LLM) and inspect.isfunction(getattr(LLM, name))
    assert _params(getattr(LLM, name)) == _params(getattr(RolloutControl, name))


@pytest.mark.parametrize("name", ["embed", "classify", "score"])
def test_each_pooling_call_is_a_method_of_llm_with_the_functions_parameters(name):
    assert inspect.isfunction(getattr(LLM, name))
    assert _params(getattr(LLM, name)) == _params(getattr(offline, name))


def test_an_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError):
        LLM.not_a_method  # noqa: B018


def test_the_rl_methods_reach_the_engine(tiny_model):
    """Bound to an ``LLM``, the methods run on its engine core (not only look right)."""
    llm = LLM(tiny_model("llama"), cpu_kernels=False, num_kv_blocks=32)
    assert llm.is_paused() is False
    llm.pause_generation()
    assert llm.is_paused() is True
    llm.resume_generation()
    assert llm.is_paused() is False and llm.reset_prefix_cache() is True
    assert len(llm.collective_rpc(lambda runner: runner.block_size)) == 1
