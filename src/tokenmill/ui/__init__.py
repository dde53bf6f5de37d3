"""Chainlit chat front-end for a running `tokenmill serve` (the `ui` extra)."""
