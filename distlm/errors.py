"""The error a user's config or command line is refused with.

Below every other module (the config, the parallel layout's rules, the readers), so that
each can refuse a value in the same one-line form: the field and the value named.
"""


class ConfigError(ValueError):
    """A user-facing config problem; the message names the field and value."""


class AgreedError(ConfigError):
    """A refusal every rank reaches alike, from a value agreed over the ranks (the memory
    check's least free memory): rank 0 says it for all, where a rank's own error is said by
    each rank that has it."""
