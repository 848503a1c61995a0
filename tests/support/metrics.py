"""Reading the service's Prometheus text in tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def drift_gauges(text: str, model: str) -> dict[str, float]:
    """`vit_drift_score` of one model, by kind (prediction, embedding); empty where it has none."""
    return {
        s.labels["kind"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vit_drift_score" and s.labels["model"] == model
    }
