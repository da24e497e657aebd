"""The kopf operator that reconciles GraphPolicy objects onto worker pods.

Import it only as ``graphkeeper.operator``: a top-level ``operator`` would shadow the standard
library's module of that name.
"""
