"""Tensor parallelism's parts (Megatron-style): layers, collectives and their overlap, how a parameter is cut,
the plan check and the plan's application (tensor.py). Which plan a model gets: zerotron/parallelize/."""
