"""The GPU runbook's closing summary: every part's figures from the run's JSON, as report lines."""

from __future__ import annotations

import json
import statistics

from tools import reporting


def _f(v, fmt):
    return "-" if v is None else fmt.format(v)


def _status(r: dict) -> list[str]:
    """A job's error or skip reason, as a report line (none when it ran)."""
    return [f"  {r.get('error') or 'skipped: ' + r['skipped']}"] if r.get("error") or r.get("skipped") else []


def _table(rows, columns):
    return reporting.table_lines(rows, columns, missing="-", rule=False, indent="  ")


def summarize(payload: dict) -> list[str]:
    jobs = payload["jobs"]
    lines = ["", "=" * 100, f"tools/gpu summary ({payload['mode']})"]
    correct = jobs.get("correct", {})
    if correct:
        parity = correct.get("zero_parity", {})
        bad = [k for k, v in parity.items() if not v.get("ok")]
        worst = max((v.get("max_weight_diff", 0) for v in parity.values()), default=None)
        lines.append(
            f"[0] correctness: {'all checks passed' if correct.get('all_ok') else 'FAILED'}; ZeRO/offload "
            f"parity {len(parity) - len(bad)}/{len(parity)} (worst weight diff {_f(worst, '{:.1e}')})"
            + (f", failing {bad}" if bad else "")
        )
        for key in (
            "overflow",
            "checkpoint_round_trip",
            "host_syncs",
            "bf16_offload",
            "ring_attention_bf16",
            "moe_grouped_bf16",
            "moe_host_syncs",
            "launch_blocking_rerun",
        ):
            lines.append(f"    {key}: {json.dumps(correct.get(key), default=str)[:200]}")
    sanitized = jobs.get("sanitized", {})
    if sanitized:
        lines.append(
            f"[4] under TORCH_CUDA_SANITIZER=1: {'no race found' if sanitized.get('all_ok') else 'FAILED'}; "
            f"{json.dumps({k: v.get('ok') for k, v in sanitized.get('zero_parity', {}).items()})[:300]}"
            + (f"; {sanitized['error']}" if sanitized.get("error") else "")
        )
    dev = next((r["device"] for r in jobs.values() if r.get("device")), {})
    if dev:
        memory = f", {dev['total_memory_gib']:.1f} GiB, CUDA {dev.get('cuda')}" if "total_memory_gib" in dev else ""
        lines.append(
            f"device: {dev.get('name', dev.get('type'))}"
            + memory
            + f"; torch {dev.get('torch')}, zerotron {dev.get('zerotron')}, Python {dev.get('python')}"
        )
    cols = [
        ("name", "system", "{}"),
        ("median_ms", "median ms", "{:.1f}"),
        ("tokens_per_s", "tokens/s", "{:,.0f}"),
        ("mfu", "MFU", "{:.1%}"),
        ("peak_gib", "peak GiB", "{:.2f}"),
        ("activations_gib", "activ. GiB", "{:.2f}"),
        ("n", "steps", "{}"),
    ]

    def rows_of(d):
        rows = []
        for name, r in d.items():
            if "median_s" in r:
                rows.append({**r, "name": name, "median_ms": r["median_s"] * 1e3, "n": len(r["step_s"])})
            else:
                rows.append({"name": f"{name}: {r.get('error', 'no result')}"})
        return rows

    r = jobs.get("mfu")
    if r:
        lines.append("")
        if r.get("model"):
            m = r["model"]
            lines.append(
                f"[1] MFU: {m['size']} GPT ({m['params'] / 1e9:.3f}B params), {r['micro_batch']} x {m['seq']} "
                f"tokens/step, bf16 + fp32 masters, fused AdamW, clip {r.get('clip')}"
            )
        if r.get("systems"):
            lines += _table(rows_of(r["systems"]), cols)
        if r.get("zerotron_vs_plain"):
            c = r["zerotron_vs_plain"]
            lines.append(
                f"  zerotron / plain: step time {c['step_time_ratio']:.3f}, peak memory "
                f"{_f(c['peak_memory_ratio'], '{:.3f}')}, max |dloss| {c['max_abs_dloss']:.2e}"
            )
        lines += _status(r)
    r = jobs.get("offload")
    if r:
        lines.append("")
        a = r.get("assessment")
        if a:
            fits = {True: "fits", False: "does not fit", None: "?"}
            gpu_part = (
                f" (of {a['gpu_total_gib']:.1f}): {fits[a['fits_gpu_without_offload']]}" if a["gpu_total_gib"] else ""
            )
            lines.append(
                f"[2] offload: {a['model']} ({a['params'] / 1e9:.2f}B params): without offload "
                f"{a['gpu_states_without_offload_gib']:.0f} GiB of model states on the GPU{gpu_part}; with "
                f"offload {a['host_with_offload_gib']:.0f} GiB of host memory (budget "
                f"{a['host_budget_gib']:.0f}): {fits[a['fits_host_with_offload']]}"
            )
        if r.get("model"):
            m = r["model"]
            what = "offload_optimizer" + (" + offload_param" if r.get("stage") == 3 else "")
            lines.append(
                f"  trained: {m['size']} shape, {m['n_layer']} layers, {m['params'] / 1e9:.2f}B params, "
                f"stage {r.get('stage')} + {what} (pinned), micro-batch {r.get('micro_batch')}"
            )
        if "median_s" in r:
            mr = r.get("memory_report_gib", {})
            lines.append(
                f"  with offload: {r['median_s']:.2f} s/step, {r['tokens_per_s']:,.0f} tokens/s"
                + (f", MFU {r['mfu']:.1%}" if r.get("mfu") else "")
                + f"; GPU peak {_f(r.get('peak_gib'), '{:.2f}')} GiB; host (memory_report) "
                f"{_f(mr.get('host'), '{:.2f}')} GiB, host RSS peak "
                f"{_f(r.get('host_peak_rss_gib'), '{:.1f}')} GiB"
            )
            s = r["steps"]
            fwd_bwd, opt = (statistics.median(x[k] for x in s) for k in ("fwd_bwd_s", "step_s"))
            lines.append(
                f"  per step: fwd+bwd {fwd_bwd:.2f}s, optimizer step (gradients to the host, CPU AdamW, "
                f"weights back) {opt:.2f}s"
            )
        if r.get("predicted_without_offload"):
            p = r["predicted_without_offload"]
            lines.append(
                f"  predicted without offload: peak {p['peak_gib']:.1f} GiB at micro-batch "
                f"{r['micro_batch']}; largest micro-batch that would fit: {p['max_micro_batch']}"
            )
        off = jobs.get("offload_off")
        if off and off.get("outcome"):
            lines.append(
                f"  without offload, same model and micro-batch: {off['outcome']}"
                + (
                    f" at {off['oom_at']} (peak before {_f(off.get('peak_before_oom_gib'), '{:.1f}')} GiB)"
                    if off["outcome"] == "OOM"
                    else f" (peak {_f(off.get('peak_gib'), '{:.2f}')} GiB)"
                )
            )
        elif off:
            lines.append(f"  without offload: {off.get('error') or off.get('skipped') or 'no result'}")
        lines += _status(r)
    r = jobs.get("ckpt")
    if r:
        lines.append("")
        if r.get("model"):
            m = r["model"]
            lines.append(
                f"[3] activation checkpointing: {m['size']} GPT ({m['params'] / 1e6:.0f}M params), "
                f"{r['micro_batch']} x {m['seq']} tokens/step, zerotron bf16 stage 0"
            )
        if r.get("policies"):
            lines += _table(
                rows_of(r["policies"]),
                cols[:-1]
                + [("step_time_vs_none", "time/none", "{:.3f}"), ("peak_vs_none", "peak/none", "{:.3f}"), cols[-1]],
            )
        lines += _status(r)
    failed = {j: r.get("error") for j, r in jobs.items() if r.get("error")}
    if failed:
        lines.append("")
        lines += [f"FAILED {j}: {e}" for j, e in failed.items()]
    lines.append("=" * 100)
    return lines
