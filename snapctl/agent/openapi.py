"""The agent's API as an OpenAPI 3.1 document, generated from what the server itself routes and
validates with: the operations and models of :mod:`snapctl.agent.api` and the request models it
imports. ``python -m snapctl.agent.openapi > docs/agent-api.json`` writes the committed copy;
``tests/agent/test_openapi.py`` fails while that copy differs from what this generates.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from snapctl.agent import API_VERSION
from snapctl.agent.api import (
    OPERATIONS,
    ErrorBody,
    NoteMessage,
    Operation,
    ProgressMessage,
    ReportMessage,
)
from snapctl.statedir.names import NAME_PATTERN

_REF = "#/components/schemas/{model}"
_NDJSON = "application/x-ndjson"
_JSON = "application/json"


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of the agent's API (v1)."""
    requests = _unique(op.body for op in OPERATIONS)
    answers = _unique([ErrorBody, ProgressMessage, NoteMessage, ReportMessage,
                       *(op.answer for op in OPERATIONS)])  # fmt: skip
    inputs: list[tuple[type[BaseModel], JsonSchemaMode]] = [(m, "validation") for m in requests]
    outputs: list[tuple[type[BaseModel], JsonSchemaMode]] = [(m, "serialization") for m in answers]
    refs, schemas = models_json_schema([*inputs, *outputs], ref_template=_REF)

    def ref(model: type[BaseModel], mode: JsonSchemaMode = "serialization") -> dict[str, Any]:
        return dict(refs[(model, mode)])

    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op, ref)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "snapctl agent API",
            "version": str(API_VERSION),
            "description": (
                "The API of `snapctl agent` (docs/agent.md): on its unix socket (STATE/agent.sock; "
                "its peer must be root or the agent's user) and, with --listen, over TCP with a "
                "bearer token. Requests are strict: unknown fields, wrong types, out-of-range "
                "values and strings holding NUL are refused (422, never echoing a value). Long "
                "operations answer NDJSON, one message per chunk: progress and notes, then the "
                "report or an ErrorBody."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": schemas.get("$defs", {}),
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The TCP listener's token (--token-file); the unix socket "
                    "takes none.",
                }
            },
        },
        "security": [{}, {"bearer": []}],
    }


def _unique(models: Any) -> list[type[BaseModel]]:
    """Each model once, in the order first named."""
    return list(dict.fromkeys(model for model in models if model is not None))


def _operation(op: Operation, ref: Any) -> dict[str, Any]:
    parameters: list[dict[str, Any]] = []
    if "{name}" in op.path:
        parameters.append({
            "name": "name", "in": "path", "required": True,
            "description": "an activation's name (or its id)",
            "schema": {"type": "string", "pattern": f"^{NAME_PATTERN.pattern}$"},
        })  # fmt: skip
    parameters += [
        {"name": query.name, "in": "query", "required": query.required,
         "description": query.description, "schema": {"type": "string"}}
        for query in op.query
    ]  # fmt: skip
    described = op.summary + (" (refused on the TCP listener: 403)" if op.unix_only else "")
    document: dict[str, Any] = {"operationId": op.name, "summary": described}
    if parameters:
        document["parameters"] = parameters
    if op.body is not None:
        document["requestBody"] = {
            "description": "JSON; an empty body is the model's defaults",
            "content": {_JSON: {"schema": ref(op.body, "validation")}},
        }
    document["responses"] = {
        "200": _answer(op, ref),
        "default": {
            "description": "A refusal or a failure (every 4xx and 5xx): its message and the "
            "CLI's exit status for it",
            "content": {_JSON: {"schema": ref(ErrorBody)}},
        },
    }
    return document


def _answer(op: Operation, ref: Any) -> dict[str, Any]:
    if op.metrics:
        return {"description": "Prometheus text format",
                "content": {"text/plain": {"schema": {"type": "string"}}}}  # fmt: skip
    if op.streamed:
        messages = [ref(op.answer)] if op.answer is not None else [
            ref(ProgressMessage), ref(NoteMessage), ref(ReportMessage)]  # fmt: skip
        return {
            "description": "NDJSON in chunks, one message each; the last is the outcome (an "
            "ErrorBody when it failed)",
            "content": {_NDJSON: {"schema": {"oneOf": [*messages, ref(ErrorBody)]}}},
        }
    if op.answer is not None:
        schema = ref(op.answer)
    else:
        schema = {"type": "object", "description": op.answer_text}
    if op.listed:
        schema = {"type": "array", "items": schema}
    return {"description": op.summary, "content": {_JSON: {"schema": schema}}}


def render() -> str:
    """The document as committed in docs/agent-api.json."""
    return json.dumps(openapi_document(), indent=2) + "\n"


if __name__ == "__main__":
    print(render(), end="")
