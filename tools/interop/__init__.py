"""Real vLLM engines (the CPU build) for the interop suite: the tiny model and a P/D pair
(docs/vllm-interop.md)."""
