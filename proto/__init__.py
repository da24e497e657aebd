"""What the CLI, the operator and the worker share: the wire contract (worker.proto and its generated
code), the graph policy model, what the enums mean, the default ports and the gRPC server options."""

#: gRPC options for every server of this contract (the worker's, and the operator's stand-in): a
#: second server on a port already taken must fail to bind, not share the port (SO_REUSEPORT).
SERVER_OPTIONS = (("grpc.so_reuseport", 0),)
