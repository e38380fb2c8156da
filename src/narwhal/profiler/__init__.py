"""narwhal-profile: measure live engines and write a profile store."""
