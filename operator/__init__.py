"""The kopf operator that reconciles GraphPolicy objects onto worker pods.

Import it only as ``graphkeeper.operator``: a top-level ``operator`` would shadow the standard
library's module of that name.

Modules, one concern each:

- ``main``: kopf settings and handler registration; ``run()`` for ``graphkeeper operator``.
- ``policy_handlers`` / ``pod_handlers``: thin kopf handlers and the two in-memory indices.
- ``reconciler``: one loop per policy (read workers, push what they lack, write status).
- ``sync``: one worker's track (last status, calls under way) and what it means, pure.
- ``rollout``: which workers may recapture or reload now (``maxUnavailable``), pure.
- ``outage``: one log line per Kubernetes API outage.
- ``selection``: pods and policies as plain values, label selectors, who owns a contested pod.
- ``status``: ``build_status``, the pure aggregation of what was observed into ``.status``.
- ``render``: the objects the operator writes (the policy ConfigMap, the status patch).
- ``kube`` / ``workerclient``: the Kubernetes calls and the GraphControl gRPC client.
- ``metrics``: the operator's Prometheus metrics, ``/metrics`` and ``/healthz``.
- ``testing``: a light GraphControl server standing in for a worker (tests, simulations).
"""
