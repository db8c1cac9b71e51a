"""The config's `flops_profiler` section in the engine: global rank 0 profiles the model's first forward
of step `profile_step` (steps count from 0, as DeepSpeed's) and prints the profile when that step ends.
Attached only when the section is enabled, so a disabled profiler costs nothing."""

from __future__ import annotations

import time

from .flops import FlopsProfiler


class EngineFlopsProfile:
    def __init__(self, engine, cfg):
        self.engine, self.cfg = engine, cfg
        self.profiler = FlopsProfiler(engine.module, engine, cfg.recompute_fwd_factor)
        self.forward_end = None  # when the profiled forward ended (None: not profiled yet)
        self.done = False
        self._watch = engine.module.register_forward_pre_hook(self._before)

    def _before(self, module, args):
        if self.forward_end is not None or self.engine.global_steps != self.cfg.profile_step:
            return
        self._watch.remove()  # once
        self.profiler.start_profile()
        self.profiler._enter(module, args)  # (this call's pre-hooks were chosen before the profiler added its own)
        # Added after the profiler's own hooks, so it runs after them, when the module's numbers are in.
        self._stop = module.register_forward_hook(self._after, always_call=True)

    def _after(self, module, args, output):
        self._stop.remove()
        self.profiler.stop_profile()
        self.forward_end = time.perf_counter()

    def after_step(self):
        """At the end of the profiled step: print (to output_file if set) and forget the profile."""
        if self.forward_end is None or self.done:
            return
        self.done = True
        prof, engine = self.profiler, self.engine
        if engine.gradient_accumulation_steps() == 1:  # else the other micro-batches' passes come in between
            prof.after_forward_latency = time.perf_counter() - self.forward_end  # backward and step
        prof.print_model_profile(
            profile_step=engine.global_steps - 1,
            module_depth=self.cfg.module_depth,
            top_modules=self.cfg.top_modules,
            detailed=self.cfg.detailed,
            output_file=self.cfg.output_file,
        )
        self.totals = {
            "flops": prof.get_total_flops(),
            "macs": prof.get_total_macs(),
            "params": prof.get_total_params(),
        }
        prof.end_profile()


def attach(engine) -> EngineFlopsProfile | None:
    """The engine's profile when the config enables it and this is global rank 0 (DeepSpeed profiles there only)."""
    cfg = engine.config.flops_profiler
    if not cfg.enabled or engine.global_rank != 0:
        return None
    return EngineFlopsProfile(engine, cfg)
