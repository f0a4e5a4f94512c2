"""Errors the CLI turns into one line and exit code 2.

Every message names what is wrong (a dotted params key, a file and line, a package) so the user
can fix it without reading a traceback.
"""


class DsparkError(ValueError):
    """Base: a bad input the user can fix."""


class ConfigError(DsparkError):
    """params.yaml (or an override) is malformed, has an unknown key, a wrong type or range."""


class TargetError(DsparkError):
    """The target model cannot be resolved or loaded."""


class DataError(DsparkError):
    """A prompt file, corpus or shard is missing or malformed."""


class ResourceError(DsparkError):
    """The machine cannot run the profile (CPU, memory, disk) or an output is unwritable."""
