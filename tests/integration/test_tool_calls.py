"""Tool calls through real clients (the ``openai`` SDK, LangChain) on a real model:
Qwen2.5-Coder-0.5B-Instruct, whose chat template takes tools, and the default SmolLM2,
whose template knows none (the tools are described to it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import pytest

from infer.api.tools import Openings, Tool, ToolPlan
from infer.bench.tool_cases import ASK_WEATHER, SCHEMAS, TOOLS, WEATHER
from support.server import running_server, served

pytestmark = pytest.mark.slow

QWEN = "qwen2.5-coder-0.5b"
SMOL = "SmolLM2-135M-Instruct"
_AUTO = ToolPlan(
    tuple(Tool(t["function"]["name"], None, t["function"]["parameters"]) for t in TOOLS),
    "auto",
    True,
    "hermes",
)
ASK = [{"role": "user", "content": ASK_WEATHER}]
CHOICES: list[Any] = ["auto", "required", {"type": "function", "function": {"name": "calculator"}}]


AppFactory = Callable[..., Any]


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


async def test_calls_come_back_parsed_in_every_choice_mode_streamed_and_not(
    qwen_app: AppFactory,
) -> None:
    def run(url: str) -> list[tuple[Any, Any]]:
        client = _client(url)
        results = []
        for choice in CHOICES:
            args = dict(model=QWEN, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0)
            whole = client.chat.completions.create(**args, max_tokens=64)
            calls: dict[int, dict[str, str]] = {}
            finish = None
            for chunk in client.chat.completions.create(**args, max_tokens=64, stream=True):
                for c in chunk.choices:
                    finish = c.finish_reason or finish
                    for d in c.delta.tool_calls or []:
                        call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                        if d.id:
                            call["id"], call["name"] = d.id, d.function.name
                        call["arguments"] += d.function.arguments or ""
                        json_prefix = call["arguments"]
                        assert (
                            whole.choices[0]
                            .message.tool_calls[0]
                            .function.arguments.startswith(json_prefix)
                        )
            results.append((whole, (calls, finish)))
        return results

    results = await served(qwen_app(engine={"max_seq_len": 1024}), run)
    for choice, (whole, (calls, finish)) in zip(CHOICES, results, strict=True):
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls" and finish == "tool_calls"
        assert message.content is None and message.tool_calls
        expected = "calculator" if isinstance(choice, dict) else "get_weather"
        for call in message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            assert call.function.name == expected
            _valid(call.function.name, call.function.arguments)
        if expected == "get_weather":
            assert json.loads(message.tool_calls[0].function.arguments)["city"] == "Paris"
        # streamed: the same call, its arguments built from prefixes of the whole text
        streamed = [(c["name"], c["arguments"]) for c in calls.values()]
        assert streamed == [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert all(c["id"].startswith("call_") for c in calls.values())


INVARIANT_PROMPTS = [
    "Reply with only a Python code block, no prose: a function that reverses a string.",
    "Give me a markdown bullet list of three fruits, nothing else.",
    "Write a markdown heading for a page about Paris, then one sentence.",
    'Reply with a quoted string: the word "hello" in French, in double quotes.',
]


async def _unconstrained_twin(
    client: httpx.AsyncClient,
    model: str,
    messages: list[dict[str, Any]],
    max_tokens: int,
    tools: list[dict[str, Any]] = TOOLS,
) -> tuple[Any, Any]:
    """The same chat request with tools under ``auto``, and its prompt (the tools rendered
    as the template renders them) completed with no grammar at all; both greedy."""
    chat = {"model": model, "messages": messages, "tools": tools, "tool_choice": "auto"}
    chat |= {"temperature": 0, "max_tokens": max_tokens, "logprobs": True}
    r = await client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    tokenized = await client.post(
        "/tokenize", json={"model": model, "messages": messages, "tools": tools}
    )
    plain = {"model": model, "prompt": tokenized.json()["tokens"], "temperature": 0}
    free = await client.post(
        "/v1/completions", json=plain | {"max_tokens": max_tokens, "logprobs": 0}
    )
    assert free.status_code == 200, free.text
    return r.json()["choices"][0], free.json()["choices"][0]


def _assert_same_reply(chat: Any, free: Any) -> None:
    """A reply that opens no call comes back as the very tokens the free completion chose."""
    assert Openings(_AUTO).scan(free["text"]) == (len(free["text"]), False), free["text"]
    message = chat["message"]
    assert "tool_calls" not in message
    assert message["content"] == free["text"]
    assert [t["token"] for t in chat["logprobs"]["content"]] == free["logprobs"]["tokens"]
    assert chat["finish_reason"] == free["finish_reason"]


async def test_under_auto_a_reply_that_opens_no_call_is_the_models_own(
    qwen_app: AppFactory,
) -> None:
    async with running_server(qwen_app(engine={"max_seq_len": 1024})) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            for prompt in INVARIANT_PROMPTS:
                messages = [{"role": "user", "content": prompt}]
                chat, free = await _unconstrained_twin(client, QWEN, messages, 48)
                _assert_same_reply(chat, free)


async def test_under_auto_a_template_without_tools_answers_as_it_would(
    real_app: AppFactory,
) -> None:
    """SmolLM2's template takes no tools (they are described to it in the system message):
    its replies that open no call are its own too."""
    async with running_server(real_app()) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            for prompt in INVARIANT_PROMPTS[:2]:
                messages = [{"role": "user", "content": prompt}]
                chat, free = await _unconstrained_twin(client, SMOL, messages, 40)
                _assert_same_reply(chat, free)


async def test_after_a_tool_result_the_reply_is_the_models_own(qwen_app: AppFactory) -> None:
    """The round trip: a call, its result, then a reply free to use the result. The 0.5B
    echoes its call and then the result's values (so the call comes back again, valid);
    what it writes after the call is the free completion's text, values and all."""
    result = {"temperature": 18, "unit": "celsius", "sky": "cloudy"}
    weather = [WEATHER]
    async with running_server(qwen_app(engine={"max_seq_len": 1024})) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            body = {"model": QWEN, "messages": ASK, "tools": weather, "temperature": 0}
            r = await client.post("/v1/chat/completions", json=body | {"max_tokens": 64})
            first = r.json()["choices"][0]["message"]
            [call] = first["tool_calls"]
            history = [
                *ASK,
                first,
                {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)},
            ]
            second, free = await _unconstrained_twin(client, QWEN, history, 48, weather)
    message = second["message"]
    for made in message.get("tool_calls") or []:
        _valid(made["function"]["name"], made["function"]["arguments"])
    content = message["content"] or ""
    assert "18" in content and "cloudy" in content  # the result's values, used
    assert free["text"].endswith(content)  # as the model wrote them, unconstrained
    assert second["finish_reason"] == ("tool_calls" if message.get("tool_calls") else "stop")


async def test_every_call_at_temperature_one_fits_its_schema(qwen_app: AppFactory) -> None:
    questions = ["What is the weather in Paris right now?", "What is 17 * 23 + 4?"]

    def run(url: str) -> list[Any]:
        client = _client(url)
        return [
            client.chat.completions.create(
                model=QWEN,
                messages=[{"role": "user", "content": q}],
                tools=TOOLS,
                tool_choice=choice,
                temperature=1.0,
                seed=7,
                n=4,
                max_tokens=64,
            )
            for choice in CHOICES
            for q in questions
        ]

    responses = await served(qwen_app(engine={"max_seq_len": 1024, "max_batch_size": 8}), run)
    calls = 0
    for i, response in enumerate(responses):
        forced = i >= len(responses) // 3  # required and named: a call in every choice
        for choice in response.choices:
            message = choice.message
            if forced and choice.finish_reason != "length":
                assert message.tool_calls, message.content
            # a reply cut by max_tokens sends the calls it finished, never the cut one
            for call in message.tool_calls or []:
                _valid(call.function.name, call.function.arguments)
                calls += 1
    assert calls >= 15  # of 24 choices; none invalid


async def test_a_call_cut_by_max_tokens_is_never_sent_as_a_call(qwen_app: AppFactory) -> None:
    body = {"model": QWEN, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    body |= {"max_tokens": 10, "temperature": 0}
    async with running_server(qwen_app(engine={"max_seq_len": 1024})) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            r = await client.post("/v1/chat/completions", json=body)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"]


async def test_bad_tool_requests_are_refused(qwen_app: AppFactory) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    call["function"]["arguments"] = '{"city": "Paris"}'
    base = {"model": QWEN, "messages": ASK, "tools": TOOLS}
    cases = {
        "user without content": base | {"messages": [{"role": "user"}]},
        "unknown tool_call_id": base
        | {
            "messages": [
                *ASK,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_2", "content": "18C"},
            ]
        },
        "parameters not a schema": base
        | {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
        "choice names no tool": base
        | {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "required without tools": {"model": QWEN, "messages": ASK, "tool_choice": "required"},
        "tools and a JSON format": base
        | {"response_format": {"type": "json_object"}, "tool_choice": "required"},
    }
    async with running_server(qwen_app(engine={"max_seq_len": 1024})) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            for what, body in cases.items():
                r = await client.post("/v1/chat/completions", json=body)
                assert 400 <= r.status_code < 500, (what, r.status_code, r.text)
                assert r.json()["error"]["code"] == "invalid_value", what


async def test_langchain_bind_tools_agent_loop_reaches_a_final_answer(
    qwen_app: AppFactory,
) -> None:
    def run(url: str) -> tuple[list[Any], list[dict[str, Any]]]:
        from langchain_core.messages import HumanMessage, ToolMessage
        from langchain_core.tools import tool
        from langchain_openai import ChatOpenAI

        executed: list[dict[str, Any]] = []

        @tool
        def get_weather(city: str) -> str:
            """Get the current weather in a city."""
            executed.append({"city": city})
            return json.dumps({"city": city, "temperature": 18, "sky": "cloudy"})

        llm = ChatOpenAI(
            base_url=f"{url}/v1", api_key="none", model=QWEN, temperature=0, max_tokens=64
        ).bind_tools([get_weather])
        messages: list[Any] = [HumanMessage("What is the weather in Paris right now?")]
        for _ in range(4):
            reply = llm.invoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                output = get_weather.invoke(call["args"])
                messages.append(ToolMessage(output, tool_call_id=call["id"]))
        return messages, executed

    messages, executed = await served(qwen_app(engine={"max_seq_len": 1024}), run)
    assert executed and executed[0]["city"] == "Paris"
    assert not messages[-1].tool_calls and messages[-1].content  # the loop ended in text


async def test_a_template_without_tools_gets_them_described(real_app: AppFactory) -> None:
    """SmolLM2's template takes no tools: they are described in the system message, and a
    required call still comes back valid (the grammar holds it to the schema)."""

    def run(url: str) -> Any:
        return _client(url).chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=128,
        )

    response = await served(real_app(), run)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    for call in message.tool_calls:
        _valid(call.function.name, call.function.arguments)
    assert response.usage.prompt_tokens > 150  # the tools' description is in the prompt
