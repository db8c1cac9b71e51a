"""Errors zerotron raises for bad input: each names the problem and the fix."""


class ConfigError(ValueError):
    """A config value is wrong. The message names the key, the value and the fix."""

    def __init__(self, key: str, value, fix: str):
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"config key '{key}' = {value!r}: {fix}")
