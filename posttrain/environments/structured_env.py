"""Structured output: the response must be JSON that validates against the row's JSON Schema.

Data fields: `schema_str` (the schema as JSON text, NeMo-Gym's name) or `schema` (an object);
NeMo-Gym's `schema_type` must be `json` when given. Validation uses the `jsonschema` library with
the validator the schema's `$schema` asks for (Draft 2020-12 by default). In `strict` mode (the
default, as NeMo-Gym's structured-outputs server) the schema is tightened first: every object
schema requires all of its `properties` and forbids additional ones. Reward 1 when the response
parses and validates, else 0.

The JSON is the whole response, or with `allow_code_fence` (default true) the content of a
```json fence that makes up the whole response.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from posttrain.environments.interface import Environment, EnvironmentReturn, MessageLog, last_assistant_text
from posttrain.environments.registry import register_env

_FENCE = re.compile(r"\A\s*```(?:json|JSON)?[ \t]*\n(.*?)\n?```\s*\Z", re.DOTALL)


class StructuredEnvConfig(BaseModel):
    """`env.structured.*`."""

    model_config = ConfigDict(extra="forbid")

    strict: bool = Field(True, description="Require every property and forbid additional ones in every object schema.")
    allow_code_fence: bool = Field(True, description="Accept a response that is one ```json fenced block.")


def strictify(schema: Any) -> Any:
    """A copy of `schema` in which every object with `properties` requires them all and allows no others."""
    schema = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                node["required"] = sorted(set(node.get("required", [])) | set(node["properties"]))
                node["additionalProperties"] = False
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return schema


def row_schema(meta: dict) -> Any:
    if meta.get("schema_type", "json") != "json":
        raise ValueError(f"schema_type {meta['schema_type']!r}: only json is supported")
    if "schema" in meta:
        return meta["schema"]
    if "schema_str" in meta:
        return json.loads(meta["schema_str"])
    raise ValueError("structured rows need 'schema_str' (JSON text) or 'schema' (an object)")


def parse_response(text: str, allow_code_fence: bool = True) -> tuple[bool, Any]:
    """(parsed?, value) of a response that should be JSON."""
    fenced = _FENCE.match(text) if allow_code_fence else None
    try:
        return True, json.loads(fenced.group(1) if fenced else text)
    except ValueError:
        return False, None


@register_env("structured")
class StructuredOutputEnvironment(Environment):
    """Single-turn JSON Schema validation. Config: `StructuredEnvConfig`."""

    config_class = StructuredEnvConfig

    def __init__(self, cfg: StructuredEnvConfig | dict | None = None):
        import jsonschema

        self.jsonschema = jsonschema
        self.cfg = cfg if isinstance(cfg, StructuredEnvConfig) else StructuredEnvConfig.model_validate(cfg or {})
        self._validators: dict[str, Any] = {}

    @classmethod
    def metadata_problem(cls, metadata: dict) -> Optional[str]:
        import jsonschema

        try:
            schema = row_schema(metadata)
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except (ValueError, jsonschema.SchemaError) as e:
            return f"invalid JSON Schema: {str(e).splitlines()[0]}"
        return None

    def _validator(self, meta: dict):
        schema = row_schema(meta)
        key = json.dumps(schema, sort_keys=True)
        if key not in self._validators:
            if self.cfg.strict:
                schema = strictify(schema)
            cls = self.jsonschema.validators.validator_for(schema)
            cls.check_schema(schema)
            self._validators[key] = cls(schema)
        return self._validators[key]

    def step(self, message_logs: list[MessageLog], metadata: list[dict]) -> EnvironmentReturn:
        rewards, observations = [], []
        for log_, meta in zip(message_logs, metadata, strict=True):
            validator = self._validator(meta)
            parsed, value = parse_response(last_assistant_text(log_), self.cfg.allow_code_fence)
            if not parsed:
                rewards.append(0.0)
                observations.append("Environment: not valid JSON")
                continue
            error = next(iter(validator.iter_errors(value)), None)
            rewards.append(float(error is None))
            observations.append("Environment: valid" if error is None else f"Environment: schema violation: {error.message[:200]}")
        n = len(message_logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": o} for o in observations], metadata=list(metadata),
            next_stop_strings=[None] * n, rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool), answers=[None] * n,
        )
