"""What the service tells its operators: Prometheus metrics, Triton's statistics, OpenTelemetry spans and
their set-up, and the log lines. Imported by every layer; imports none of them."""
