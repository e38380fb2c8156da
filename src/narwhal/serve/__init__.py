"""narwhal-serve: the OpenAI-compatible P/D router."""
