"""Every Triton kernel, the one Triton import guard, the kernel choices and timing helpers.

Imports nothing else of the worker.
"""
