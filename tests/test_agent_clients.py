"""Real clients of the newer surfaces, against ``minivllm serve`` on the default model:
the OpenAI Agents SDK (Responses API, a function tool, to a final answer) and
``instructor`` (a pydantic model extracted in its tools and JSON-schema modes)."""

from __future__ import annotations

import json

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
def test_agents_sdk_runs_a_function_tool_to_a_final_answer(server):
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
                                            max_tokens=60, parallel_tool_calls=False))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert asked and all(isinstance(c, str) and c for c in asked)
    assert result.final_output == f"It is sunny and 21 degrees in {asked[0]}."
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item"]
    assert [o.type for o in result.raw_responses[0].output] == ["function_call"]
    assert len(asked) == 1


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_output_tokens_is_dropped(server, stream):
    """The issue's run: parallel calls allowed (the SDK's default), 48 tokens. SmolLM2
    repeats its call until cut; the whole call is a function_call, the cut one is
    neither a call nor message text, and the response says incomplete (on which the
    Agents SDK stops, as it does against OpenAI)."""
    from openai import OpenAI

    tool = {"type": "function", "name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"], "additionalProperties": False}}
    with OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        kwargs = dict(model=SERVED, input="What is the weather in Paris?", tools=[tool],
                      tool_choice="required", temperature=0, max_output_tokens=48)
        if stream:
            events = list(client.responses.create(stream=True, **kwargs))
            assert events[-1].type == "response.incomplete"
            r = events[-1].response
        else:
            r = client.responses.create(**kwargs)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["function_call"]  # no message with the cut JSON
    assert r.output[0].name == "get_weather"
    assert isinstance(json.loads(r.output[0].arguments)["city"], str)


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
