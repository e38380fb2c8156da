"""Narwhal: a disaggregated prefill/decode router for vLLM fleets."""

__version__ = "0.1.0"
