"""The OpenAI-compatible HTTP server on the engine: `specdecode serve`."""
