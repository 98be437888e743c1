"""Twenty JSON schemas for structured-output tests: nested objects, arrays, enums,
numbers with bounds, required and optional fields.

Strings, arrays and the digits of numbers are bounded (``maxLength``,
``maxItems``, ``multipleOf``: powers of two, exact in floats) so a random-weight model, which never chooses to
close a string, still finishes within a test's ``max_tokens``: the grammar, not
the model, must make every output valid.
"""

from __future__ import annotations

import json

_NAME = {"type": "string", "maxLength": 8}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": _NAME}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25}},
     "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _NAME, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                         "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"name": _NAME, "nickname": _NAME}, "required": ["name"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 1,
                                                                             "maximum": 5}},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"name": _NAME, "roles": {"type": "array", "maxItems": 2,
                                                                   "items": {"enum": ["admin", "dev", "ops"]}}},
        "required": ["name", "roles"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                          {"type": "boolean"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["id", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "label": {"enum": ["low", "high"]}},
     "required": ["level", "label"], "additionalProperties": False},
    {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.5},
                                      "unit": {"enum": ["%", "pp"]}},
     "required": ["ratio"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"title": _NAME, "done": {"type": "boolean"},
                                      "priority": {"type": "integer", "minimum": 1, "maximum": 3}},
     "required": ["title", "done", "priority"], "additionalProperties": False},
    {"type": "object", "properties": {"event": {"enum": ["start", "stop"]}, "meta": {
        "type": "object", "properties": {"retries": {"type": "integer", "minimum": 0, "maximum": 3},
                                         "note": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["retries", "note"], "additionalProperties": False}},
     "required": ["event", "meta"], "additionalProperties": False},
]

assert len(SCHEMAS) == 20

# A realistic nested schema (an order with a customer, line items and a status).
ORDER_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24},
            "email": {"type": "string", "maxLength": 32},
            "tier": {"enum": ["free", "pro", "enterprise"]}},
            "required": ["name", "tier"], "additionalProperties": False},
        "items": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
            "price": {"type": "number", "minimum": 0, "maximum": 10000, "multipleOf": 0.01}},
            "required": ["sku", "quantity", "price"], "additionalProperties": False}},
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "notes": {"type": ["string", "null"], "maxLength": 40},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
}


def schema_text(schema: dict) -> str:
    return json.dumps(schema)
