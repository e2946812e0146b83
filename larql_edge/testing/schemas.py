"""Twenty varied JSON schemas (nested objects, enums, arrays, required fields, numbers, booleans, nulls),
each with one instance that validates, for structured-output tests and the grammar-engine benchmark.

The schemas keep to what OpenAI's strict mode accepts (every property required, no additional
properties), so the same list serves ``response_format: json_schema, strict: true``.
"""

from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


# Strings and numbers are bounded, as schemas meant for small models should be: unbounded, a 135M-270M
# model decoding greedily may repeat inside one ("A.A.A.A...", "1234567890123...") until max_tokens.
S = {"type": "string", "maxLength": 24}
I = {"type": "integer", "minimum": -1000000, "maximum": 1000000}  # noqa: E741
N = {"type": "number", "minimum": -1000000, "maximum": 1000000, "multipleOf": 0.01}  # bounded decimals too
B = {"type": "boolean"}

# (name, schema, an instance that validates)
SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    ("person", _obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}}), {"name": "Ada", "age": 36}),
    ("colour", _obj({"colour": {"type": "string", "enum": ["red", "green", "blue"]}}), {"colour": "green"}),
    ("flags", _obj({"done": B, "urgent": B}), {"done": False, "urgent": True}),
    ("tags", _obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 4}}), {"tags": ["a", "b"]}),
    ("point", _obj({"x": N, "y": N}), {"x": 1.5, "y": -2}),
    ("address", _obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
     {"street": "1 Main St", "city": "Springfield", "zip": "12345"}),
    ("nested", _obj({"user": _obj({"id": I, "profile": _obj({"nick": S, "verified": B})})}),
     {"user": {"id": 7, "profile": {"nick": "z", "verified": True}}}),
    ("order", _obj({"items": {"type": "array", "maxItems": 2,
                              "items": _obj({"sku": {"type": "string", "pattern": "^[A-Z0-9]{1,8}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 99}})},
                    "total": N}),
     {"items": [{"sku": "A1", "qty": 2}], "total": 9.5}),
    ("status", _obj({"status": {"enum": ["ok", "error", "pending"]}, "code": I}), {"status": "ok", "code": 200}),
    ("nullable", _obj({"note": {"type": ["string", "null"], "maxLength": 24}}), {"note": None}),
    ("matrix", _obj({"rows": {"type": "array", "maxItems": 3,
                              "items": {"type": "array", "items": I, "maxItems": 3}}}), {"rows": [[1, 2], [3]]}),
    ("event", _obj({"title": S, "day": {"type": "string", "enum": ["mon", "tue", "wed", "thu", "fri"]},
                    "attendees": {"type": "array", "items": S, "maxItems": 3}}),
     {"title": "standup", "day": "mon", "attendees": ["x"]}),
    ("rating", _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": S}),
     {"stars": 4, "comment": "good"}),
    ("const", _obj({"kind": {"const": "reply"}, "text": S}), {"kind": "reply", "text": "hi"}),
    ("choice", _obj({"answer": {"anyOf": [I, {"type": "string", "enum": ["unknown"]}]}}), {"answer": "unknown"}),
    ("book", _obj({"title": S, "authors": {"type": "array", "items": _obj({"first": S, "last": S}), "maxItems": 2},
                   "year": I, "in_print": B}),
     {"title": "T", "authors": [{"first": "A", "last": "B"}], "year": 1999, "in_print": False}),
    ("weather", _obj({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}, "temperature": N}),
     {"city": "Oslo", "unit": "celsius", "temperature": -3.5}),
    ("bools", {"type": "array", "items": B, "minItems": 2, "maxItems": 4}, [True, False]),
    ("tree", _obj({"label": S, "children": {"type": "array", "maxItems": 2, "items": _obj({"label": S, "leaf": B})}}),
     {"label": "root", "children": [{"label": "c", "leaf": True}]}),
    ("contact", _obj({"email": {"type": "string", "maxLength": 32},
                      "phones": {"type": "array", "items": {"type": "string", "pattern": "^[+0-9 ]{3,16}$"}, "maxItems": 2},
                      "primary": {"enum": ["email", "phone"]}}),
     {"email": "a@b.c", "phones": [], "primary": "email"}),
]

# One prompt per schema: what a user would write asking for that shape.
PROMPTS = {
    "person": "Describe a famous scientist.", "colour": "Pick a colour.", "flags": "Is the task done? Is it urgent?",
    "tags": "Give some tags for a cooking blog post.", "point": "Give a point on a plane.",
    "address": "Give a postal address.", "nested": "Describe a user account.", "order": "Write a shop order.",
    "status": "Report the status of a web request.", "nullable": "Leave a note, or none.",
    "matrix": "Give a small matrix of integers.", "event": "Plan a meeting.", "rating": "Rate a restaurant.",
    "const": "Reply to a greeting.", "choice": "How many moons has Mars?", "book": "Describe a novel.",
    "weather": "What is the weather in a city?", "bools": "List some true/false values.",
    "tree": "Describe a small tree of labels.", "contact": "Give contact details.",
}
