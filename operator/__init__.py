"""The kopf operator that reconciles GraphPolicy objects onto worker pods.

Import it only as ``graphkeeper.operator``: a top-level ``operator`` would shadow the standard
library's module of that name.

Modules, one concern each:

- ``main``: kopf settings and handler registration; ``run()`` for ``graphkeeper operator``.
- ``policy_handlers`` / ``pod_handlers``: thin kopf handlers and the two in-memory indices.
- ``reconciler``: one loop per policy; one run reads workers, pushes what they lack, writes the
  ConfigMap and the status (the only writer of both).
- ``desired``: what a spec asks for, parsed once per run, for the pushes and the ConfigMap.
- ``worker_calls``: status reads, pushes and reloads, each a task; who holds each worker.
- ``sync``: one worker's track (last status, calls under way) and what it means, pure.
- ``rollout``: which workers may recapture or reload now (``maxUnavailable``), pure.
- ``traffic``: capture sizes from the fleet's traffic (``recommend``, the apply rule), pure.
- ``events``: which Events a run posts, pure.
- ``outage``: one log line per Kubernetes API outage.
- ``selection``: pods and policies as plain values, label selectors, who owns a contested pod.
- ``status``: ``build_status``, the pure aggregation of what was observed into ``.status``.
- ``render``: the objects the operator writes (the policy ConfigMap, the status patch).
- ``kube`` / ``workerclient``: the Kubernetes calls and the GraphControl gRPC client.
- ``metrics``: the operator's Prometheus metrics, ``/metrics`` and ``/healthz``.

A light GraphControl server standing in for a worker lives in ``tests/fakes/fake_worker.py``.
"""
