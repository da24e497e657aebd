"""The worker's wire contract (worker.proto and its generated code), the graph policy model and
the gRPC server options that the operator and the worker share."""

#: gRPC options for every server of this contract (the worker's, and the operator's stand-in): a
#: second server on a port already taken must fail to bind, not share the port (SO_REUSEPORT).
SERVER_OPTIONS = (("grpc.so_reuseport", 0),)
