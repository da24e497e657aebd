"""graphkeeper: LLM inference workers with managed CUDA graphs on Kubernetes.

Subpackages: ``graphkeeper.proto`` (the wire contract and the shared policy model),
``graphkeeper.worker`` (the inference worker) and ``graphkeeper.operator`` (the kopf operator).
"""

__version__ = "0.1.0"
