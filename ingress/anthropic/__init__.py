"""The Anthropic Messages API adapter: wire models, conversion, rendering and routes."""

from ingress.anthropic.models import anthropic_validation_message
from ingress.anthropic.routes import router

__all__ = ["anthropic_validation_message", "router"]
