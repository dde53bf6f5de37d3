"""OpenAI-compatible HTTP server: `tokenmill serve MODEL`."""
