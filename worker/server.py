"""The worker's gRPC services: InferenceWorker, GraphControl, health and reflection.

Handlers translate between the wire and the engine and map every refusal to a status code with
a message: INVALID_ARGUMENT for bad input (naming the field), RESOURCE_EXHAUSTED for a full
queue, FAILED_PRECONDITION for a stale policy generation, UNAVAILABLE while not serving.
"""

from __future__ import annotations

import logging
import queue
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto import worker_pb2_grpc as pb_grpc
from graphkeeper.proto.policy import PolicyError
from graphkeeper.worker.admission import AdmissionError
from graphkeeper.worker.engine import Engine, NotServing, QueueFull, StalePolicy
from graphkeeper.worker.lifecycle import SERVING_STATES

log = logging.getLogger(__name__)

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["InferenceWorker"].full_name
CONTROL_SERVICE = pb.DESCRIPTOR.services_by_name["GraphControl"].full_name
RELOAD_TIMEOUT_SECONDS = 600.0


class InferenceServicer(pb_grpc.InferenceWorkerServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):  # noqa: N802
        events: queue.SimpleQueue = queue.SimpleQueue()
        try:
            seq = self.engine.submit(request, lambda kind, payload: events.put((kind, payload)))
        except AdmissionError as err:
            self.engine.metrics.requests.labels("invalid").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except QueueFull as err:
            self.engine.metrics.requests.labels("queue_full").inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        except NotServing as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        # A client that cancels or disconnects frees its slot at the next step.
        context.add_callback(lambda: self.engine.cancel(seq))
        while True:
            try:
                kind, payload = events.get(timeout=1.0)
            except queue.Empty:
                if self.engine.failed is not None:
                    context.abort(grpc.StatusCode.INTERNAL, f"engine stopped: {self.engine.failed}")
                continue
            if kind == "tokens":
                yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=payload))
            else:
                yield pb.GenerateResponse(completion=payload)
                return

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext):  # noqa: N802
        loaded, s = self.engine.loaded, self.engine.settings
        if loaded is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "model not loaded yet")
        c = loaded.config
        return pb.GetModelInfoResponse(
            source=loaded.source, revision=loaded.revision, architecture="LlamaForCausalLM",
            dtype=str(loaded.dtype).removeprefix("torch."), vocab_size=c.vocab_size, hidden_size=c.dim,
            num_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
            max_seq_len=s.max_seq_len, max_num_seqs=s.max_num_seqs, eos_token_id=c.eos_token_id,
            device=str(loaded.device), parameter_count=loaded.parameter_count,
        )


class GraphControlServicer(pb_grpc.GraphControlServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def ApplyGraphPolicy(self, request: pb.ApplyGraphPolicyRequest, context: grpc.ServicerContext):  # noqa: N802
        try:
            return self.engine.apply_policy(request.policy)
        except PolicyError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"policy.{err}")
        except StalePolicy as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))

    def GetGraphStatus(self, request: pb.GetGraphStatusRequest, context: grpc.ServicerContext):  # noqa: N802
        return self.engine.status()

    def LoadModelRevision(self, request: pb.LoadModelRevisionRequest, context: grpc.ServicerContext):  # noqa: N802
        if not request.source:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "source: must name a directory or random:<preset>")
        future = self.engine.load_revision(request.source, request.revision)
        try:
            revision = future.result(timeout=RELOAD_TIMEOUT_SECONDS)
        except futures.TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "model reload did not finish in time")
        except Exception as err:  # noqa: BLE001 - reported to the caller; the worker keeps serving
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"source: {err}")
        return pb.LoadModelRevisionResponse(revision=revision, recapture_started=self.engine.device.type == "cuda")


def build_server(engine: Engine, host: str, port: int) -> tuple[grpc.Server, int]:
    """The gRPC server with every service registered; returns it unstarted with its bound port.

    Each streaming Generate holds a handler thread, so the pool covers every running and queued
    request plus room for control calls; beyond that gRPC itself answers RESOURCE_EXHAUSTED.
    """
    s = engine.settings
    max_workers = s.max_num_seqs + s.max_queue + 16
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        maximum_concurrent_rpcs=max_workers,
    )
    pb_grpc.add_InferenceWorkerServicer_to_server(InferenceServicer(engine), server)
    pb_grpc.add_GraphControlServicer_to_server(GraphControlServicer(engine), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    _track_health(engine, health_servicer)
    names = (INFERENCE_SERVICE, CONTROL_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}")
    return server, bound


def _track_health(engine: Engine, servicer: health.HealthServicer) -> None:
    """Inference is SERVING only while ready; the control plane answers from the start."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    servicer.set(CONTROL_SERVICE, serving)

    def on_state(state: int) -> None:
        status = serving if state in SERVING_STATES else not_serving
        servicer.set(INFERENCE_SERVICE, status)
        servicer.set("", status)

    engine.lifecycle.subscribe(on_state)
