"""The OpenAI-compatible HTTP server in front of an EngineClient (ARCHITECTURE.md: server layer)."""
