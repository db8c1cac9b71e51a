"""Cutting a list of layers into contiguous parts, one per (virtual) pipeline stage.

Methods, as DeepSpeed's PipelineModule names them:
- "uniform": the same number of layers per part (the first parts take one more when it doesn't divide);
- "parameters": balance the trainable parameter count with DeepSpeed's rule (the usual choice for
  transformers, whose blocks are equal and whose embeddings are large);
- "type:REGEX": balance the layers whose class name matches REGEX (case-insensitive); the layers
  between them follow, so "type:Block" puts the embedding with the first block and the head with
  the last.
"""

from __future__ import annotations

import re


def partition(weights: list[float], parts: int) -> list[int]:
    """Boundaries b (len parts + 1, b[0] = 0, b[-1] = len(weights)) of contiguous non-empty parts,
    chosen by DeepSpeed's rule for partition_method="parameters", so that a model is cut where
    DeepSpeed cuts it: a dynamic program over (layers so far, parts so far) that keeps, for each,
    the cut with the smallest spread (heaviest part minus lightest), ties going to the later cut."""
    n = len(weights)
    if parts > n:
        raise ValueError(f"cannot split {n} layers into {parts} pipeline parts; use fewer stages or more layers")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # per (i layers, j parts): (spread, heaviest, lightest) of the chosen cut, and where it was cut
    spread = [[inf] * (parts + 1) for _ in range(n + 1)]
    heaviest = [[inf] * (parts + 1) for _ in range(n + 1)]
    lightest = [[inf] * (parts + 1) for _ in range(n + 1)]
    cut = [[0] * (parts + 1) for _ in range(n + 1)]
    spread[0][0] = heaviest[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(i):
                w = prefix[i] - prefix[k]
                hi, lo = max(heaviest[k][j - 1], w), min(lightest[k][j - 1], w)
                if hi - lo <= spread[i][j]:
                    spread[i][j], heaviest[i][j], lightest[i][j], cut[i][j] = hi - lo, hi, lo, k
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(cut[bounds[-1]][j])
    return bounds[::-1]


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
        raise ValueError(
            f"partition_method 'type:{pattern}' matches {len(hits)} layers ({', '.join(sorted(set(names)))} "
            f"are the layer types), fewer than the {parts} pipeline parts; change the pattern or the stages"
        )
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
