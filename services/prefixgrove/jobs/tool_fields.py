"""A chat body's `tools` and `tool_choice` (OpenAI's shapes) and vLLM's `include_reasoning`, as
vLLM's OpenAI server serves them.

- `tools` are rendered through the model's chat template (tokenize.py), which must take them.
- `tool_choice` "auto" (the default with tools): the reply is parsed for tool calls in the format
  of the model's chat template (tool_calls.py: Hermes / Qwen `<tool_call>`, Mistral `[TOOL_CALLS]`,
  Llama 3 JSON); "none": the reply is text; "required" and a named function are enforced with
  structured outputs, as vLLM enforces them: "required" holds the reply to a JSON array of
  `{"name", "parameters"}` objects of the tools (one at most with `parallel_tool_calls` false), a
  named function to its parameters' schema.
- `include_reasoning` false leaves a reasoning model's thinking out of the reply.

What the output line needs travels in the params, left out of SamplingParams (vllm_fields.py):
`tool_choice` ("none", "auto", "required" or {"name": ...}) and `include_reasoning`; the parser
(`tool_parser`) and whether the model thinks (`reasoning`) are the chat template's, set where it is
rendered.
"""

from __future__ import annotations

from typing import Any

from prefixgrove.jobs.request_errors import InvalidRequest, shown

_NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_request(body: dict[str, Any], params: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools to render (None: none), after adding to `params` what the reply needs."""
    include = body.get("include_reasoning")
    if include is not None:
        if not isinstance(include, bool):
            raise InvalidRequest(
                "invalid_value", f"include_reasoning must be a boolean, got {shown(include)}"
            )
        if not include:
            params["include_reasoning"] = False
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools == []:  # OpenAI refuses it too
        raise InvalidRequest("invalid_value", "tools must not be empty: leave it out instead")
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequest(
                "invalid_value", f"tool_choice {shown(choice)} needs tools: give the tools too"
            )
        return None
    checked = _tools(tools)
    by_name = {t["function"]["name"]: t["function"] for t in checked}
    params["tool_choice"] = choice = _choice(choice, by_name)
    constraint = None
    if choice == "required":
        constraint = {"json": _required_schema(list(by_name.values()))}
        if body.get("parallel_tool_calls") is False:  # OpenAI's meaning: at most one call
            constraint["json"]["maxItems"] = 1
    elif isinstance(choice, dict):
        constraint = {"json": by_name[choice["name"]].get("parameters") or _NO_PARAMETERS}
    if constraint is not None:
        if "structured_outputs" in params:
            raise InvalidRequest(
                "invalid_value",
                f"tool_choice {shown(body['tool_choice'])} and an output constraint both "
                "constrain the reply: give at most one",
            )
        params["structured_outputs"] = constraint
    return checked


def _tools(tools: Any) -> list[dict[str, Any]]:
    expected = (
        "tools must be a list of {'type': 'function', 'function': {'name', 'description', "
        "'parameters'}} with names of their own"
    )
    if not isinstance(tools, list):
        raise InvalidRequest("invalid_value", f"{expected}, got {shown(tools)}")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        parameters = function.get("parameters") if isinstance(function, dict) else None
        if (
            tool.get("type") != "function"
            or not isinstance(name, str)
            or not name
            or name in names
            or not (parameters is None or isinstance(parameters, dict))
        ):
            raise InvalidRequest("invalid_value", f"{expected}; tools[{i}] is {shown(tool)}")
        names.add(name)
    return tools


def _choice(choice: Any, tools: dict[str, Any]) -> str | dict[str, str]:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return str(choice)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if isinstance(choice, dict) and choice.get("type") == "function" and name in tools:
        return {"name": str(name)}
    raise InvalidRequest(
        "invalid_value",
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
        f"{{'name': <one of {', '.join(sorted(tools))}>}}}}, got {shown(choice)}",
    )


def _required_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": one or more calls of the tools."""
    calls = [
        {
            "properties": {
                "name": {"type": "string", "enum": [f["name"]]},
                "parameters": f.get("parameters") or _NO_PARAMETERS,
            },
            "required": ["name", "parameters"],
        }
        for f in functions
    ]
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
