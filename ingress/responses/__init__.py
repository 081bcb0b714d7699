"""The OpenAI Responses API adapter: wire models, conversion, rendering, store and routes."""
