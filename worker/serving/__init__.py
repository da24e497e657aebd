"""The API layer: gRPC servers, wire conversions, admission and the metrics/probe HTTP server.

It sees the engine only through ``graphkeeper.worker.engine``.
"""
