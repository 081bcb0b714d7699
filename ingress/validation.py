"""Pydantic validation errors -> one clear message naming the offending field."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    field = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        text = f"'{field}' is required"
    else:
        text = f"invalid value for '{field}': {message}" if field else message
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return text, field
