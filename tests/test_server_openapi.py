"""/openapi.json: the API is published, with the request and response bodies of chat and
completions (their routes read the raw body, so the schema is added explicitly), every reference resolvable."""
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from tandem.server.app import build_app  # noqa: E402


class _Client:
    """The least an app needs to publish its schema (no engine)."""

    model_name = "m"
    max_model_len = 16

    def is_healthy(self) -> bool:
        return True


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_openapi_json_lists_the_routes_and_their_bodies_with_resolvable_references():
    """Protects the published schema: the OpenAI routes, request bodies naming messages/prompt and the vLLM
    extras, responses, and no dangling $ref; reachable without the API key like /health."""
    doc = TestClient(build_app(_Client(), api_key="k")).get("/openapi.json")
    assert doc.status_code == 200
    spec = doc.json()
    assert {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"} <= set(spec["paths"])
    comps = spec["components"]["schemas"]
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {"messages", "tools", "tool_choice", "response_format", "n", "logit_bias", "session_id"} <= set(
        comps["ChatCompletionRequest"]["properties"])
    assert {"prompt", "echo", "return_token_ids"} <= set(comps["CompletionRequest"]["properties"])
    assert "ChatCompletionResponse" in str(chat["responses"]["200"])
    for ref in _refs(spec):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in comps, ref
