"""Data preparation: documents in, token shards plus a manifest out.

Submodules are imported on demand (``distlm.data.prepare``, ``.tokenizer``,
``.sources``) so that importing this package stays cheap: spawned tokenizer
workers import it and should not pay for numpy or pyarrow.
"""


class DataError(ValueError):
    """A problem with the user's data or options, worded for the user.

    The message is one line naming the file, field or value at fault; the CLI
    prints it as ``error: <message>`` and exits with status 2.
    """


__all__ = ["DataError"]
