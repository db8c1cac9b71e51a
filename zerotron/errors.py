"""Errors zerotron raises for bad input: each names the problem and the fix."""


class ZerotronError(Exception):
    """An error whose message says all a user needs: in a launched job it is reported as that
    message alone, without a traceback (error_report.py). `same_on_every_rank`: raised alike by every
    rank (from the config and the model alone), so rank 0 speaks for all."""

    same_on_every_rank = False


class ConfigError(ZerotronError, ValueError):
    """A config value is wrong. The message names the key, the value and the fix."""

    same_on_every_rank = True

    def __init__(self, key: str, value, fix: str):
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"config key '{key}' = {value!r}: {fix}")

    def __reduce__(self):
        # Rebuilt from its three parts when unpickled: an exception is pickled as cls(*args), which would call
        # __init__ with the message alone, fail, and leave a multiprocessing pool waiting forever for the result
        # (DeepSpeed's unit tests run their ranks in such a pool).
        return type(self), (self.key, self.value, self.fix)


# Exit codes (sysexits.h): a job that stops on purpose says why through its status.
EXIT_FAULT = 70  # EX_SOFTWARE: a collective timed out, or another rank stopped the job
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: SIGTERM/SIGINT; a checkpoint was saved; run again with --resume


class CollectiveMismatch(ZerotronError, RuntimeError):
    """Ranks called different collectives at the same point (collective checks, a debug mode)."""


class NonFiniteError(ZerotronError, FloatingPointError):
    """Too many consecutive steps had NaN/Inf gradients: training stops instead of going on with garbage."""


class BadBatchError(ZerotronError, ValueError):
    """A batch the model cannot take (token ids outside the vocabulary, an empty batch): named
    before the forward runs, so nothing is corrupted."""


class MisuseError(ZerotronError, RuntimeError, AssertionError):
    """A training verb called where it cannot work (engine.step() inside engine.no_sync(), no_sync() nested or
    with partitioned gradients). An AssertionError too because DeepSpeed refuses these by assertion: code that
    catches DeepSpeed's refusal catches zerotron's."""
