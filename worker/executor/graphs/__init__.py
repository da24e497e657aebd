"""CUDA graphs: modes and the capture plan, the dispatcher, the capture controller, graph sets and the
capture job."""
