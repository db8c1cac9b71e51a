"""bench/checkpoint.py's probe phase: one `zerotron convert` in this process, instrumented to say where its
memory goes (anonymous or file-backed pages, the mapped rank files), with mmap or pread."""

from __future__ import annotations

import json
import time

from bench.checkpoint_measure import mapped_rss, proc_status, reset_peak


# ---- phase: an instrumented convert (one process, no torchrun) ------------------------------------------
def phase_probe(args):
    """Run convert() in this process with probes of RssAnon / RssFile: before reading the pieces of each
    parameter, after reading them (inside assemble), after assembling, and while the bytes go to the file
    (for the largest tensor and after the last write also the resident bytes of the mapped rank files,
    from smaps, which costs ~50 ms a read: convert_in_process_s includes that). The peak is reset after the
    imports, so VmHWM at the end is the exact peak of convert() itself. With --probe-pread, the
    checkpoint's files are opened with safetensors' pread backend instead of mmap (what-if, no edit)."""
    import gc

    import zerotron.checkpoint.export as export
    import zerotron.checkpoint.load as load

    src, out, largest = args.probe_src, args.probe_out, args.probe_largest
    samples = []
    current = {"name": None}
    RANK_FILES = r"rank\d+\.safetensors"

    def sample(where, maps=False):
        samples.append(
            {
                "param": current["name"],
                "where": where,
                **proc_status(),
                **({"rank_files_mapped_rss": mapped_rss(RANK_FILES)} if maps else {}),
            }
        )

    real_full, real_assemble = load.SavedPieces.full, load.assemble

    def full(self, name, kind):
        current["name"] = name
        sample("before reading pieces")
        t = real_full(self, name, kind)
        sample("assembled (pieces freed)")
        return t

    def assemble(parts, name):
        sample("pieces read (get_tensor)")
        return real_assemble(parts, name)

    class ProbedFile:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            sample(f"file.write of {len(data)} bytes", maps=current["name"] == largest)
            return self.f.write(data)

        def flush(self):  # close() flushes after the last tensor: the rank files' mapped pages then
            current["name"] = None
            sample("after the last write", maps=True)
            return self.f.flush()

        def __getattr__(self, name):
            return getattr(self.f, name)

    real_init = export.StreamingSafetensors.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        self.file = ProbedFile(self.file)

    load.SavedPieces.full, load.assemble, export.StreamingSafetensors.__init__ = full, assemble, init
    if args.probe_pread:
        real_open = load.safe_open
        load.safe_open = lambda *a, **k: real_open(*a, **{**k, "backend": "pread"})
    gc.collect()
    reset_peak()
    sample("imports done", maps=True)
    t0 = time.perf_counter()
    export.convert(src, out, "fp32")
    seconds = time.perf_counter() - t0
    current["name"] = None
    sample("convert returned", maps=True)
    base = samples[0]
    peak = max(samples, key=lambda s: s["RssAnon"])
    report = {
        "backend": "pread" if args.probe_pread else "mmap (safetensors default)",
        "convert_in_process_s": seconds,
        "after_imports": base,
        "end": samples[-1],
        "peak_anon_sample": peak,
        "largest_param_samples": [s for s in samples if s["param"] == largest],
        "anon_delta_max_bytes": peak["RssAnon"] - base["RssAnon"],
        "file_delta_max_bytes": max(s["RssFile"] for s in samples) - base["RssFile"],
        "rank_files_mapped_rss_max_bytes": max(s.get("rank_files_mapped_rss", 0) for s in samples),
        "peak_growth_bytes": samples[-1]["VmHWM"] - base["VmRSS"],
    }
    print(json.dumps(report))
