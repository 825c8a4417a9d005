"""Metrics (Prometheus) and tracing (OpenTelemetry)."""
