"""Grafana dashboards as code, the Prometheus scrape configuration and PromQL checks
(docs/metrics.md, docs/operations.md)."""
