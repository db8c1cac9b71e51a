"""`deepspeed.runtime.zero.utils`: ZeRORuntimeException, what scripts catch around ZeRO's set-up. DeepSpeed raises
it when ZeRO refuses a setting at initialize; zerotron refuses those with its own errors (ConfigError and the
other ZerotronError subclasses, which name the key and the fix), so the name is their common base: an
`except ZeRORuntimeException` block catches zerotron's refusal."""

from ....errors import ZerotronError

ZeRORuntimeException = ZerotronError

__all__ = ["ZeRORuntimeException"]
