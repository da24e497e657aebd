"""The default ports of a worker and of the operator, spelled once for all Python code.

The CLI's flags, the worker, the operator (a pod that names no ``grpc`` port) and the client
commands read them here. The Helm chart and the example manifests keep their own copies (YAML
cannot import these); ``tests/test_chart.py`` holds the chart's defaults to these values.
"""

from __future__ import annotations

#: InferenceWorker and gRPC health: what clients and the readiness probe call.
GRPC_PORT = 50051
#: GraphControl, on a port of its own so it can be bound and guarded apart from inference.
CONTROL_PORT = 50052
#: The worker's Prometheus ``/metrics``.
METRICS_PORT = 9400
#: The worker's OpenAI-compatible HTTP API.
HTTP_PORT = 8000
#: The operator's metrics and ``/healthz``.
OPERATOR_METRICS_PORT = 9500
