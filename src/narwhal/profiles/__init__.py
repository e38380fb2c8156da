"""Latency models and the profile store format (pure: no files, no sockets, no clock)."""
