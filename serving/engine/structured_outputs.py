"""What a request's output must match: a JSON schema, any JSON object, a regular expression,
one of a few strings, or a grammar (vLLM's ``StructuredOutputsParams``, the same names).

This module only says *what* is asked and checks its types; ``grammar.py`` compiles it
(llguidance) and refuses what does not compile, naming the field.
"""

from __future__ import annotations

import dataclasses
import json

from shiftjax.serving.engine.errors import InvalidRequest

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 1024
MAX_SPEC_CHARACTERS = 1 << 20  # a schema or grammar this long is a mistake, not a constraint


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: ``json``, a JSON schema (its JSON text; :meth:`from_json_schema`
    takes a dict); ``json_object``, any JSON object; ``regex``, a regular expression (Rust
    ``regex`` syntax, matched in full); ``choice``, one of these strings; ``grammar``, a
    Lark grammar or llama.cpp's GBNF (llguidance reads both).

    The field named in an :class:`InvalidRequest` is ``structured_outputs.<kind>``; a front
    end renames it to what its request spelled (``response_format.json_schema``).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequest("structured_outputs", f"give exactly one of {', '.join(KINDS)}, got "
                                                       f"{', '.join(given) or 'none'}")
        if not isinstance(self.json_object, bool):
            raise InvalidRequest("structured_outputs.json_object", "must be a bool")
        for kind in ("json", "regex", "grammar"):
            value = getattr(self, kind)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise InvalidRequest(f"structured_outputs.{kind}", "must be a non-empty string")
            if len(value) > MAX_SPEC_CHARACTERS:
                raise InvalidRequest(f"structured_outputs.{kind}",
                                     f"is {len(value)} characters, more than {MAX_SPEC_CHARACTERS}")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as error:
                raise InvalidRequest("structured_outputs.json", f"is not valid JSON ({error})") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest("structured_outputs.json", "must be a JSON schema: an object or a bool")
        if self.choice is not None:
            if (not isinstance(self.choice, tuple) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidRequest("structured_outputs.choice", "must be a non-empty tuple of non-empty strings")
            if len(self.choice) > MAX_CHOICES:
                raise InvalidRequest("structured_outputs.choice", f"has {len(self.choice)} strings, "
                                                                  f"more than {MAX_CHOICES}")

    @classmethod
    def from_json_schema(cls, schema: dict | bool | str) -> "StructuredOutputs":
        """A JSON-schema constraint from the schema as a dict (or its JSON text). Keys keep
        their order: llguidance generates properties in the order the schema declares them
        (a "reasoning" field before an "answer" one)."""
        if isinstance(schema, str):
            return cls(json=schema)
        try:
            text = json.dumps(schema, separators=(",", ":"))
        except (TypeError, ValueError) as error:
            raise InvalidRequest("structured_outputs.json", f"is not JSON-serializable ({error})") from None
        return cls(json=text)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))
