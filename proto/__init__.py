"""The worker's wire contract (worker.proto and its generated code) and the graph policy model
that the operator and the worker share."""
