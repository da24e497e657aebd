"""The inference worker: model, KV cache, scheduler, graph runner, gRPC server and metrics."""
