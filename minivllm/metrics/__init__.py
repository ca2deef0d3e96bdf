from minivllm.metrics.request_metrics import RequestMetrics

__all__ = ["RequestMetrics"]
