"""Tool-calling cases shared by the tool-call benchmark (``bench/tool_calls.py``) and the
tests: two function tools in OpenAI's chat shape, and questions that call for them."""

from __future__ import annotations

from typing import Any

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
CALCULATOR: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
TOOLS = [WEATHER, CALCULATOR]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = "What is the weather in Paris right now?"
QUESTIONS = [
    ASK_WEATHER,
    "Is it raining in Tokyo?",
    "How warm is it in Cairo today, in fahrenheit?",
    "What is 17 * 23 + 4?",
    "Compute the square root of 1764.",
    "What's 15% of 240?",
    "Should I take an umbrella in London?",
    "Add 1234 and 9876.",
]


def responses_shape(tool: dict[str, Any]) -> dict[str, Any]:
    """A chat-shaped function tool in the Responses API's flat shape."""
    return {"type": "function", **tool["function"]}
