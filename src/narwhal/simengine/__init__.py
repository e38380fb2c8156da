"""Simulated vLLM engine: vLLM's OpenAI + NixlConnector wire protocol, the production fleet's
timing, deterministic generation, and real KV bytes moved between processes over NIXL."""
