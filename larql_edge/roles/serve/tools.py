"""Tools on chat: ``tools`` and ``tool_choice`` checked, the forced calls' grammar, the replies' ``tool_calls``.

- The tools go to the chat template as transformers gives them (``tools=[{"type": "function",
  "function": {...}}]``); a template that does not use them ignores them (Gemma 3's and SmolLM2's).
- ``tool_choice: "required"`` and a named function are enforced with the grammar engine, as vLLM
  does: a named function's reply is its arguments object, valid against the function's
  ``parameters``; ``required`` replies a JSON list of one or more ``{"name", "parameters"}`` calls,
  each name one of the tools and its parameters valid against that tool's schema.
- A ``required`` reply ends at its first repeated call: a small model decoding greedily may list the
  same calls over and over until ``max_tokens`` (Gemma 3 270M alternates two), and an identical call
  (same name, same arguments) twice in one reply is never what an application wants. The sequence
  stops once a call equal to an earlier one is whole (`ToolPlan.repeats`), the repeat is dropped, and
  the reply is the calls before it, ``finish_reason: "tool_calls"``. At most `MAX_PARALLEL_CALLS`
  calls per reply (the grammar's ``maxItems``) bound distinct calls too; ``parallel_tool_calls:
  false``: one.
- ``auto`` (the default with tools) parses the model's own tool-call syntax, where its chat template
  defines one (`syntax_of`): Hermes/Qwen 2.5 ``<tool_call>{...}</tool_call>``, Llama 3.1/3.2 JSON
  ``{"name": ..., "parameters": ...}``, Mistral ``[TOOL_CALLS][...]``. Other families answer text.
- ``none``: the tools reach the template, the reply is text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from larql_edge.errors import BadRequest

MAX_TOOLS = 128  # OpenAI's limit
MAX_PARALLEL_CALLS = 16  # calls in one `required` reply (OpenAI publishes none; vLLM has none)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _bad(message: str, param: str, code: str = "invalid_value") -> BadRequest:
    e = BadRequest(message)
    e.param = param  # type: ignore[attr-defined]
    e.code = code  # type: ignore[attr-defined]
    return e


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # as the request gave them (for the template)
    choice: str  # "none" | "auto" | "required" | "function"
    function: str | None = None  # the named function's name
    parallel: bool = True  # parallel_tool_calls: false holds ``required`` to one call

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object", "properties": {}}
        raise KeyError(name)

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced reply follows (None: not forced)."""
        if self.choice == "function":
            assert self.function is not None
            return self.parameters(self.function)
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "parameters": self.parameters(t["function"]["name"])},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            return {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1,
                    "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return None

    def repeats(self, text: str) -> bool:
        """A ``required`` reply's text so far ends a call equal to an earlier one: the reply is whole."""
        if self.choice != "required":  # (a token may close a call and start the next: "}}, {" is one of Gemma's)
            return False
        items = _whole_items(text)
        return len(items) > 1 and items[-1] in items[:-1]


def _whole_items(text: str) -> list[Any]:
    """The whole values at the start of a JSON array's text (what follows them may be cut short)."""
    dec = json.JSONDecoder()
    at = len(text) - len(text.lstrip())
    if not text.startswith("[", at):
        return []
    at += 1
    out: list[Any] = []
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            value, at = dec.raw_decode(text, at)
        except ValueError:
            return out
        out.append(value)


def plan(tools: Any, tool_choice: Any, parallel_tool_calls: Any = None) -> ToolPlan | None:
    """Check ``tools`` and ``tool_choice`` (400 naming the field at fault); None when there are no tools."""
    if parallel_tool_calls is not None and type(parallel_tool_calls) is not bool:
        raise _bad("parallel_tool_calls must be a boolean", "parallel_tool_calls", "invalid_type")
    parallel = parallel_tool_calls is not False
    if tools is None:
        if tool_choice not in (None, "none", "auto"):  # nothing to require or name without tools
            raise _bad("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise _bad("tools must be a non-empty list", "tools", "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"tools: at most {MAX_TOOLS}", "tools")
    names = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise _bad(f'{where} must be {{"type": "function", "function": {{...}}}}', where, "invalid_type")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.function.name must be 1 to 64 letters, digits, _ or -", f"{where}.function.name")
        if name in names:
            raise _bad(f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise _bad(f"{where}.function.description must be a string", f"{where}.function.description", "invalid_type")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise _bad(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters",
                       "invalid_type")
        if f.get("strict") is not None and type(f["strict"]) is not bool:
            raise _bad(f"{where}.function.strict must be a boolean", f"{where}.function.strict", "invalid_type")
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan(tools, "auto", parallel=parallel)
    if tool_choice in ("none", "required"):
        return ToolPlan(tools, tool_choice, parallel=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise _bad(f"tool_choice names the function {str(name)[:64]!r}, which is not among the tools",
                       "tool_choice.function.name")
        return ToolPlan(tools, "function", name, parallel)
    raise _bad('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
               "tool_choice")


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def call(name: str, arguments: Any) -> dict[str, Any]:
    """One entry of a reply's ``tool_calls`` (arguments: a JSON string, as OpenAI sends them)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def forced_calls(p: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    """The calls of a grammar-forced reply; None when the text is not complete JSON (max_tokens cut it).
    A ``required`` reply that ended at a repeated call (`ToolPlan.repeats`) is the calls before it."""
    try:
        value = json.loads(text)
    except ValueError:
        if not p.repeats(text):
            return None
        value = _whole_items(text)[:-1]
    if p.choice == "function":
        assert p.function is not None
        return [call(p.function, text)]
    return [call(c["name"], c["parameters"]) for c in value]


# -- auto: the model's own syntax ------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def syntax_of(template_source: str | None) -> str | None:
    """The tool-call syntax a chat template teaches its model, or None (the families documented above)."""
    src = template_source or ""
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|python_tag|>" in src or ("ipython" in src and '"parameters"' in src):
        return "llama3_json"
    return None


def _named(obj: Any, args_key: str) -> tuple[str, Any] | None:
    if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get(args_key, {}), dict):
        return obj["name"], obj.get(args_key, {})
    return None


def parse_auto(syntax: str | None, text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of an ``auto`` reply; calls of functions not among ``names`` are left as text."""
    if syntax is None:
        return text, []
    found: list[tuple[str, Any]] = []
    content = text
    if syntax == "hermes":
        for m in _HERMES.finditer(text):
            try:
                got = _named(json.loads(m.group(1)), "arguments")
            except ValueError:
                got = None
            if got is None or got[0] not in names:
                return text, []
            found.append(got)
        content = _HERMES.sub("", text).strip()
    elif syntax == "mistral":
        head, sep, tail = text.partition("[TOOL_CALLS]")
        if sep:
            try:
                items = json.loads(tail.strip())
            except ValueError:
                return text, []
            for it in items if isinstance(items, list) else [items]:
                got = _named(it, "arguments")
                if got is None or got[0] not in names:
                    return text, []
                found.append(got)
            content = head.strip()
    elif syntax == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        try:
            got = _named(json.loads(body), "parameters")
        except ValueError:
            got = None
        if got is not None and got[0] in names:
            found.append(got)
            content = ""
    calls = [call(n, a) for n, a in found]
    return (content or None) if calls else text, calls


class ToolReply:
    """How one choice's generated text becomes the reply's message (or stream deltas) under a `ToolPlan`.

    - forced, a named function: the text is the call's arguments, streamed as they come (the first
      delta names the call, each further one appends to ``function.arguments``, as OpenAI streams);
    - forced ``required`` and ``auto`` with a family syntax: the text is held to its end, then parsed
      (a call list cannot be told from prose before it is whole); its calls go out as two deltas each;
    - otherwise (``none``, ``auto`` without a syntax): plain text, streamed as always.
    A reply cut by ``max_tokens`` before its calls are whole JSON stays text, finish ``length``.
    """

    def __init__(self, p: ToolPlan, syntax: str | None):
        self.plan, self.syntax = p, syntax
        self.names = {t["function"]["name"] for t in p.tools}
        self.streams_text = p.choice == "none" or (p.choice == "auto" and syntax is None)
        self.held: list[str] = []
        self.id = call_id()
        self.started = False

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole choice's message and finish_reason."""
        calls = self._calls(text, finish)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        content = None
        if self.plan.choice == "auto":
            content, calls = parse_auto(self.syntax, text, self.names)
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def _calls(self, text: str, finish: str | None) -> list[dict[str, Any]]:
        if finish != "stop" or self.streams_text:
            return []
        if self.plan.forced:
            got = forced_calls(self.plan, text)
            if got and self.plan.choice == "function":
                got[0]["id"] = self.id
            return got or []
        return parse_auto(self.syntax, text, self.names)[1]

    def delta(self, piece: str) -> list[dict[str, Any]]:
        """The ``delta`` objects a released piece of text becomes (none while it is held)."""
        if self.streams_text:
            return [{"content": piece}]
        if self.plan.choice != "function":
            self.held.append(piece)
            return []
        self.held.append(piece)
        out = []
        if not self.started:
            self.started = True
            out.append({"tool_calls": [{"index": 0, "id": self.id, "type": "function",
                                        "function": {"name": self.plan.function, "arguments": ""}}]})
        if piece:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        return out

    def close(self, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas still owed at the end, and the finish_reason of the closing chunk."""
        if self.streams_text:
            return [], finish
        text = "".join(self.held)
        if self.plan.choice == "function":
            if finish == "stop" and forced_calls(self.plan, text):
                return ([] if self.started else self.delta("")), "tool_calls"
            return [], finish  # cut short: the arguments already sent are all there is
        msg, fin = self.message(text, finish)
        if fin != "tool_calls":
            return ([{"content": text}] if text else []), finish
        out: list[dict[str, Any]] = [{"content": msg["content"]}] if msg.get("content") else []
        for i, c in enumerate(msg["tool_calls"]):
            out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                        "function": {"name": c["function"]["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
        return out, "tool_calls"
