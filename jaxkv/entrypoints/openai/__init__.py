"""The OpenAI-compatible HTTP server: request parsing and limits, the server itself."""
