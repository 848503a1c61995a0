"""The Prometheus series: one set per model, labelled with its name, there from the start."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from app.telemetry.metrics import Metrics, ModelMetrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_each_models_series_exist_at_zero_and_count_its_batches() -> None:
    metrics = Metrics()
    a, b = ModelMetrics(metrics, "a"), ModelMetrics(metrics, "b")
    at_start = samples(metrics)
    assert at_start[("vit_images_processed_total", (("model", "b"),))] == 0
    # what an alert on rate(...) needs before the first drop or failure
    for reason in ("cancelled", "expired"):
        assert at_start[("vit_images_dropped_total", (("model", "b"), ("reason", reason)))] == 0
    assert at_start[("vit_model_load_failures_total", (("model", "b"),))] == 0
    a.batch_done(8, 0.02)
    a.batch_done(4, 0.01)
    a.dropped("cancelled", 2)
    b.queue_depth(5)
    s = samples(metrics)
    assert s[("vit_images_processed_total", (("model", "a"),))] == 12
    assert s[("vit_batch_size_count", (("model", "a"),))] == 2
    assert s[("vit_batch_size_sum", (("model", "a"),))] == 12
    assert s[("vit_images_processed_total", (("model", "b"),))] == 0
    assert s[("vit_images_dropped_total", (("model", "a"), ("reason", "cancelled")))] == 2
    assert s[("vit_queue_depth", (("model", "b"),))] == 5


def test_garbage_collections_are_timed_while_watched() -> None:
    import gc

    metrics = Metrics()
    metrics.watch_gc()
    try:
        gc.collect()
    finally:
        metrics.unwatch_gc()
    count = samples(metrics)[("vit_gc_pause_seconds_count", (("generation", "2"),))]
    gc.collect()
    assert count >= 1 and samples(metrics)[("vit_gc_pause_seconds_count", (("generation", "2"),))] == count
