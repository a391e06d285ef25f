"""Triton kernels for shardbridge's hot paths, each with a pure-torch twin in `reference`.

Imports torch and triton only. `_backend` decides, when called, whether a launch goes to
Triton on the GPU, to the Triton interpreter (tests on CPU), or to the torch reference.
"""
