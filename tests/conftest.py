from __future__ import annotations

from narwhal.testing.fleet import loopback_only

# NIXL must never probe real interfaces or log to stdout during tests, and tests only ever talk
# to 127.0.0.1: never through a proxy.
loopback_only()
