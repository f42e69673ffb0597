"""Kernels: each op has a readable torch reference and a Triton kernel with the same signature.

Importing this package never imports triton; backends are chosen at call time.
"""
