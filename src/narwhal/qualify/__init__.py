"""narwhal-qualify: the qualification run as one command."""
