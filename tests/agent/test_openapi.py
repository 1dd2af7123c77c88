"""The API's OpenAPI document: the committed docs/agent-api.json is what the models and the
operations the server routes generate (so it cannot drift from them), and it names every
route the agent answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from snapctl.agent.api import OPERATIONS
from snapctl.agent.openapi import openapi_document, render

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "agent-api.json"


def test_the_committed_document_is_the_generated_one() -> None:
    assert COMMITTED.read_text() == render(), (
        "docs/agent-api.json is out of date: run python -m snapctl.agent.openapi > "
        "docs/agent-api.json"
    )


def test_the_module_prints_the_document() -> None:
    done = subprocess.run([sys.executable, "-m", "snapctl.agent.openapi"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert done.stdout == render()


def test_every_operation_and_model_is_documented() -> None:
    document = openapi_document()
    assert document["openapi"].startswith("3.1")
    documented = {(path, method.upper()) for path, item in document["paths"].items()
                  for method in item}  # fmt: skip
    assert documented == {(op.path, op.method) for op in OPERATIONS}
    schemas = document["components"]["schemas"]
    text = json.dumps(document)
    for ref in {part.split('"')[0] for part in text.split('"$ref": "#/components/schemas/')[1:]}:
        assert ref in schemas, ref  # every reference resolves
    for op in OPERATIONS:
        if op.body is not None:
            body = document["paths"][op.path][op.method.lower()]["requestBody"]
            assert body["content"]["application/json"]["schema"] == {
                "$ref": f"#/components/schemas/{op.body.__name__}"
            }
    # A secret field is documented as one (never its value's example).
    assert schemas["CopyRequest"]["properties"]["api_key"]["anyOf"][0]["writeOnly"] is True
