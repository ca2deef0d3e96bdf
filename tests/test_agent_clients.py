"""Real clients of the newer surfaces, against ``minivllm serve`` on the default model:
the OpenAI Agents SDK (Responses API, a function tool, to a final answer) and
``instructor`` (a pydantic model extracted in its tools and JSON-schema modes)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from tests.helpers import ServerProcess

SERVED = "smollm2"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("agents"), "--served-model-name", SERVED,
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("parallel, max_tokens", [(False, 60), (None, 48)])
def test_agents_sdk_runs_a_function_tool_to_a_final_answer(server, parallel, max_tokens):
    """Parallel calls allowed (the SDK's default) and 48 tokens: SmolLM2 repeats its call
    until cut; the whole call is a call, the cut one dropped, and the run still ends."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    asked = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        asked.append(city)
        return f"It is sunny and 21 degrees in {city}."

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    # The model must call the tool (SmolLM2-135M under "auto" keeps calling it), and
    # the tool's answer is the agent's final answer ("stop_on_first_tool").
    agent = agents.Agent(
        name="weather", instructions="You answer questions about the weather.",
        tools=[get_weather], tool_use_behavior="stop_on_first_tool",
        model=agents.OpenAIResponsesModel(model=SERVED, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                            max_tokens=max_tokens,
                                            parallel_tool_calls=parallel))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert asked and all(isinstance(c, str) and c for c in asked)
    assert result.final_output == f"It is sunny and 21 degrees in {asked[0]}."
    kinds = [item.type for item in result.new_items]
    assert sorted(kinds) == ["tool_call_item"] * len(asked) + ["tool_call_output_item"] * len(
        asked)
    first = result.raw_responses[0]
    assert [o.type for o in first.output] == ["function_call"] * len(asked)
    if parallel is False:
        assert len(asked) == 1


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extracts_a_pydantic_model(server, mode):
    instructor = pytest.importorskip("instructor")
    from openai import OpenAI

    client = instructor.from_openai(
        OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0),
        mode=getattr(instructor.Mode, mode))
    city = client.chat.completions.create(
        model=SERVED, response_model=City, max_retries=1, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Paris is the capital of France. "
                   "Extract the city and its country."}])
    assert isinstance(city, City)
    assert "Paris" in city.name
