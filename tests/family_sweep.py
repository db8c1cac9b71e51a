"""The mechanics the Transformers family sweeps share (test_hf_tensor_parallel.py,
test_hf_expert_parallel.py): each family's one-process reference, then each layout's verdict
('ok' | 'refused' | 'FAIL', or 'unbuilt' when the tiny model or plain PyTorch fails: no finding about
zerotron), the table, and the checks every sweep makes of its results."""

from __future__ import annotations

import sys
import time
from collections import Counter

import torch.distributed as dist


def sweep(families, layouts: dict, reference, split, names=None) -> dict:
    """On each rank: family -> {layout: (verdict, detail), "seconds": s}; `reference(cls_name)` ->
    whatever `split(cls_name, layout_value, *reference)` compares against."""
    import transformers

    transformers.logging.set_verbosity_error()
    out = {}
    for family, cls_name in families:
        if names and family not in names:
            continue
        start = time.monotonic()
        try:
            ref = reference(cls_name)
        except Exception as e:  # noqa: BLE001 - the tiny model or plain PyTorch failed: not zerotron's
            out[family] = {layout: ("unbuilt", f"{type(e).__name__}: {str(e)[:300]}") for layout in layouts}
        else:
            out[family] = {}
            for layout, value in layouts.items():
                try:
                    out[family][layout] = split(cls_name, value, *ref)
                except Exception as e:  # noqa: BLE001 - a family that breaks the sweep is a finding, not a crash
                    out[family][layout] = ("FAIL", f"{type(e).__name__}: {str(e)[:300]}")
        out[family]["seconds"] = round(time.monotonic() - start, 2)
        if dist.get_rank() == 0:
            verdicts = " / ".join(out[family][layout][0] for layout in layouts)
            print(f"[sweep] {family}: {verdicts} in {out[family]['seconds']} s", file=sys.stderr, flush=True)
        dist.barrier()
    return out


def table(results: dict, layouts) -> str:
    first = next(iter(layouts))
    lines = []
    for family, r in results.items():
        cells = "  ".join(f"{r[layout][0]:8s}" for layout in layouts)
        note = next((r[layout][1] for layout in layouts if r[layout][0] != "ok"), r[first][1])
        lines.append(f"{family:24s} {cells} {note[:160]}")
    counts = {layout: Counter(r[layout][0] for r in results.values()) for layout in layouts}
    unbuilt = sorted(f for f, r in results.items() if r[first][0] == "unbuilt")
    lines.append(
        f"{len(results)} families; "
        + "; ".join(
            f"{layout}: {c['ok']} match, {c['refused']} refused, {c['FAIL']} failed" for layout, c in counts.items()
        )
        + f"; {len(unbuilt)} cannot be built tiny{' (' + ', '.join(unbuilt) + ')' if unbuilt else ''}"
    )
    return "\n".join(lines)


def check(results: list[dict], layouts) -> str:
    """Every rank agrees, nothing failed, at least half the families matched and at most a tenth
    could not be built (the family fitting in hf_families.py still works); returns the table."""
    first = next(iter(layouts))
    verdicts = [{f: tuple(r[layout][0] for layout in layouts) for f, r in ranked.items()} for ranked in results]
    assert all(v == verdicts[0] for v in verdicts), "the ranks disagree"
    mine = results[0]
    failed = {f: r for f, r in mine.items() if any(r[layout][0] == "FAIL" for layout in layouts)}
    assert not failed, "\n" + table(failed, layouts)
    assert sum(r[first][0] == "ok" for r in mine.values()) >= len(mine) // 2, table(mine, layouts)
    assert sum(r[first][0] == "unbuilt" for r in mine.values()) <= len(mine) // 10, table(mine, layouts)
    return table(mine, layouts)
