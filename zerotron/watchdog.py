"""Hangs become messages: the collectives in flight on every rank, watched from a side thread.

`Comm` registers each collective here while it runs (`begin` ... `end`). A daemon thread on every
rank publishes what its rank is doing (step, collectives in flight, the last one finished per
group) to the job's key-value store about once a second, and watches two things:

- its own oldest collective: past the timeout it reads every rank's state, writes a message naming
  the operation, the group, the step, the ranks that arrived and where the others are, and stops
  the job;
- the store's `abort` key: when another rank stopped the job (a timeout, bad input), it prints that
  rank's message and exits too, so no rank is left waiting for the backend's own timeout.

Works alike on gloo and NCCL: it needs only the store every torch.distributed job has. With
`collective_checks` on (a debug mode), each collective first compares its operation, shapes and
dtypes across the group through the store and names the first rank that diverges.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import sys
import threading
import time

import torch.distributed as dist

from .errors import EXIT_FAULT, CollectiveMismatch
from .timeouts import requested_timeout


def default_timeout_s() -> float:
    """$ZEROTRON_COLLECTIVE_TIMEOUT, else the timeout init_distributed was given, else 600 s (the
    config's zerotron.collective_timeout overrides all three)."""
    if "ZEROTRON_COLLECTIVE_TIMEOUT" in os.environ:
        return float(os.environ["ZEROTRON_COLLECTIVE_TIMEOUT"])
    requested = requested_timeout()
    return requested.total_seconds() if requested is not None else 600.0


class _Call:
    __slots__ = ("op", "group", "ranks", "seq", "detail", "since", "work")

    def __init__(self, op, group, ranks, seq, detail):
        self.op, self.group, self.ranks, self.seq, self.detail = op, group, ranks, seq, detail
        self.since = time.monotonic()
        self.work = None  # an asynchronous call's backend work: finished when it completes

    def describe(self) -> str:
        return f"{self.op} #{self.seq} on group {self.group} {self.detail}".rstrip()


class Watchdog:
    def __init__(self, store, rank: int, world: int, timeout_s: float | None = None):
        self.store = dist.PrefixStore("zerotron/watchdog/", store)
        self.rank = rank
        # Each rank touches the store about twice per poll: poll less often in very large jobs.
        self.timeout_s = default_timeout_s() if timeout_s is None else timeout_s
        self.poll_s = max(1.0, world / 512) if self.timeout_s >= 10 else 0.5
        self.checks = os.environ.get("ZEROTRON_COLLECTIVE_CHECKS", "0") == "1"
        self.step = 0
        self._lock = threading.Lock()
        self._pending: dict[int, _Call] = {}
        self._seq: dict[str, int] = {}
        self._finished: dict[str, str] = {}
        self._published = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="zerotron-watchdog", daemon=True)
        self._thread.start()
        # A daemon thread still inside a store call when the interpreter finalizes is killed while
        # re-taking the GIL, and that aborts the process (SIGABRT, "terminate called without an
        # active exception") after the job has finished: stop it first.
        atexit.register(self.stop)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10 * self.poll_s)

    # ---- called by Comm ------------------------------------------------------------------------
    def begin(self, op: str, group: str, ranks: list[int], detail: str = "") -> _Call:
        with self._lock:
            seq = self._seq[group] = self._seq.get(group, 0) + 1
            call = _Call(op, group, ranks, seq, detail)
            self._pending[id(call)] = call
        if self.checks and len(ranks) > 1 and op != "p2p":
            self._compare(call)
        return call

    def track(self, call: _Call, work) -> None:
        """An asynchronous call returned at once (NCCL, or gloo's async work): it stays pending until
        its work completes, waited on or not, so a collective that never completes is seen."""
        call.work = work

    def end(self, call: _Call) -> None:
        with self._lock:
            if self._pending.pop(id(call), None) is not None:
                self._finished[call.group] = f"{call.op} #{call.seq}"

    def _end_completed(self) -> None:
        with self._lock:
            done = [c for c in self._pending.values() if c.work is not None and completed(c.work)]
        for c in done:
            self.end(c)

    # ---- mismatch checks (debug mode) --------------------------------------------------------------
    def _compare(self, call: _Call) -> None:
        """Every rank of the group writes what it is about to call; all must agree."""
        key = f"check/{call.group}/{call.seq}/"
        mine = f"{call.op} {call.detail}".strip() + f" at step {self.step}"  # the same step, too
        self.store.set(key + str(self.rank), mine)
        others = [key + str(r) for r in call.ranks if r != self.rank]
        try:
            self.store.wait(others, datetime.timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 (a store timeout: someone never called it)
            missing = [r for r in call.ranks if r != self.rank and not self.store.check([key + str(r)])]
            self.fail(
                f"collective check: rank(s) {missing} never called collective #{call.seq} on group "
                f"{call.group} (rank {self.rank} calls {mine}) within {self.timeout_s:g} s{self._where(missing)}"
            )
        for r in call.ranks:
            theirs = self.store.get(key + str(r)).decode()
            if theirs != mine:
                message = (
                    f"collective mismatch: collective #{call.seq} on group {call.group}: "
                    f"rank {self.rank} calls {mine}, rank {r} calls {theirs}. The ranks took different "
                    "paths (a branch on rank-local data, a skipped or extra collective)."
                )
                self._abort(message)
                raise CollectiveMismatch(message)
        if call.seq > 2:  # the keys of two calls ago are read by everyone by now
            self.store.delete_key(f"check/{call.group}/{call.seq - 2}/{self.rank}")

    # ---- the side thread ------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_s):
            if not dist.is_initialized():  # the job ended (destroy_process_group): the store may be gone
                return
            try:
                self._end_completed()
                self._publish()
                if self.store.check(["abort"]):
                    message = self.store.get("abort").decode()
                    if not message.startswith(f"rank {self.rank}:"):  # this rank raises its own error
                        self._exit(f"stopping: {message}")
                with self._lock:
                    oldest = min(self._pending.values(), key=lambda c: c.since, default=None)
                if oldest is not None and time.monotonic() - oldest.since > self.timeout_s:
                    self.fail(self._timeout_message(oldest))
            except Exception as e:  # noqa: BLE001 (the store is gone: the job is ending)
                if not dist.is_initialized():
                    return
                print(f"[zerotron] watchdog on rank {self.rank}: {e}", file=sys.stderr)

    def _state(self) -> dict:
        with self._lock:
            now = time.monotonic()
            return {
                "step": self.step,
                "finished": dict(self._finished),
                "pending": [
                    {"call": c.describe(), "group": c.group, "seq": c.seq, "waiting_s": round(now - c.since, 1)}
                    for c in self._pending.values()
                ],
            }

    def _publish(self) -> None:
        state = self._state()
        text = json.dumps(state, sort_keys=True)
        if text != self._published or state["pending"]:
            self.store.set(f"state/{self.rank}", text)
            self._published = text

    def _states(self, ranks) -> dict[int, dict]:
        out = {}
        for r in ranks:
            if self.store.check([f"state/{r}"]):
                out[r] = json.loads(self.store.get(f"state/{r}"))
        return out

    def _where(self, ranks) -> str:
        time.sleep(2 * self.poll_s)  # every waiting rank republishes each poll: read fresh states
        states = self._states(ranks)
        lines = []
        for r in ranks:
            s = states.get(r)
            if s is None:
                lines.append(f"\n  rank {r}: no state published (it never reached the engine, or died)")
                continue
            doing = "; ".join(f"in {p['call']} for {p['waiting_s']:g} s" for p in s["pending"]) or "not in a collective"
            lines.append(
                f"\n  rank {r}: at step {s['step']}, {doing}; last finished per group: "
                + (", ".join(f"{g} {c}" for g, c in sorted(s["finished"].items())) or "none")
            )
        return "".join(lines)

    def _timeout_message(self, call: _Call) -> str:
        self._publish()
        time.sleep(2 * self.poll_s)
        states = self._states(call.ranks)
        arrived = [
            r for r in call.ranks if any(p["call"] == call.describe() for p in states.get(r, {}).get("pending", []))
        ]
        elsewhere = [r for r in call.ranks if r not in arrived]
        return (
            f"collective timeout at step {self.step}: {call.describe()} (ranks {call.ranks}) waited "
            f"{time.monotonic() - call.since:.0f} s (timeout {self.timeout_s:g} s). Arrived: ranks {arrived}; "
            f"not arrived: ranks {elsewhere}:{self._where(elsewhere)}\nA rank that skips, adds or reorders a "
            "collective hangs the others; ZEROTRON_COLLECTIVE_CHECKS=1 names the first divergence."
        )

    # ---- stopping -------------------------------------------------------------------------------
    def _abort(self, message: str) -> None:
        """Tell every rank (first writer wins)."""
        try:
            self.store.compare_set("abort", "", f"rank {self.rank}: {message}")
        except Exception:  # noqa: BLE001
            pass

    def fail(self, message: str) -> None:
        self._abort(message)
        self._exit(message)

    def _exit(self, message: str) -> None:
        print(f"[zerotron] rank {self.rank}: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_FAULT)


def completed(work) -> bool:
    """Whether a backend work is done (a failed one counts: its wait() raises in the main thread)."""
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 (a failed work: its wait() raises in the main thread)
        return True


_watchdog: Watchdog | None = None


def current() -> Watchdog | None:
    """The process's watchdog if one was started."""
    return _watchdog


def get() -> Watchdog | None:
    """The process's watchdog, started with the first Comm of a multi-rank job."""
    global _watchdog
    if _watchdog is None and dist.is_initialized() and dist.get_world_size() > 1:
        store = dist.distributed_c10d._get_default_store()
        _watchdog = Watchdog(store, dist.get_rank(), dist.get_world_size())
    return _watchdog


def configure(timeout_s: float | None = None, checks: bool | None = None) -> None:
    """Set the collective timeout and the mismatch-check mode (from the config's zerotron section)."""
    w = get()
    if w is not None:
        if timeout_s is not None:
            w.timeout_s = timeout_s
        if checks is not None:
            w.checks = checks or w.checks


def set_step(step: int) -> None:
    if _watchdog is not None:
        _watchdog.step = step


def abort(message: str) -> None:
    """Record why this rank is stopping, so the others stop with the same message."""
    if _watchdog is not None:
        _watchdog._abort(message)
