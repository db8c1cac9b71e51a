"""Cutting a list of layers into contiguous parts, one per (virtual) pipeline stage.

Methods, as DeepSpeed's PipelineModule names them:
- "uniform": the same number of layers per part (the first parts take one more when it doesn't divide);
- "parameters": balance the trainable parameter count (the usual choice for transformers, whose
  blocks are equal and whose embeddings are large);
- "type:REGEX": balance the layers whose class name matches REGEX (case-insensitive); the layers
  between them follow, so "type:Block" puts the embedding with the first block and the head with
  the last.
"""
from __future__ import annotations

import re


def partition(weights: list[float], parts: int) -> list[int]:
    """Boundaries b (len parts + 1, b[0] = 0, b[-1] = len(weights)) of contiguous non-empty parts
    that minimise the heaviest part and, among those, spread the rest evenly (least sum of squared
    part weights). Exact, by two dynamic programs over cut positions."""
    n = len(weights)
    if parts > n:
        raise ValueError(f"cannot split {n} layers into {parts} pipeline parts; use fewer stages or more layers")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    heaviest = _best(prefix, parts, lambda acc, w: max(acc, w), cap=float("inf"))[0]
    return _best(prefix, parts, lambda acc, w: acc + w * w, cap=heaviest * (1 + 1e-9) + 1e-12)[1]


def _best(prefix, parts, combine, cap):
    """Minimise combine-folded part weights over partitions whose parts all weigh <= cap."""
    n, inf = len(prefix) - 1, float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[k][i]: first i layers in k parts
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                w = prefix[i] - prefix[j]
                if w > cap or best[k - 1][j] == inf:
                    continue
                cost = combine(best[k - 1][j], w)
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [n], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return best[parts][n], bounds[::-1]


def uniform(n: int, parts: int) -> list[int]:
    if parts > n:
        raise ValueError(f"cannot split {n} layers into {parts} pipeline parts; use fewer stages or more layers")
    base, extra = divmod(n, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (k < extra))
    return bounds


def by_type(names: list[str], pattern: str, parts: int) -> list[int]:
    """Split the matching layers uniformly; each part starts at its first matching layer."""
    regex = re.compile(pattern, re.IGNORECASE)
    hits = [i for i, name in enumerate(names) if regex.search(name)]
    if len(hits) < parts:
        raise ValueError(f"partition_method 'type:{pattern}' matches {len(hits)} layers ({', '.join(sorted(set(names)))} "
                         f"are the layer types), fewer than the {parts} pipeline parts; change the pattern or the stages")
    per = uniform(len(hits), parts)
    return [0] + [hits[per[k]] for k in range(1, parts)] + [len(names)]


def partition_layers(method: str, names: list[str], param_counts: list[int], parts: int) -> list[int]:
    method = method.strip()
    if method.lower() == "uniform":
        return uniform(len(names), parts)
    if method.lower() == "parameters":
        return partition([float(c) for c in param_counts], parts)
    if method.lower().startswith("type:"):
        return by_type(names, method[5:], parts)
    raise ValueError(f"unknown partition_method {method!r}: use 'parameters', 'uniform' or 'type:REGEX'")
