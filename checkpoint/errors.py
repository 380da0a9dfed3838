"""Errors of the checkpoint layer; each says what was expected, what was found and what to do."""


class CheckpointNotFoundError(FileNotFoundError):
    """No committed checkpoint where one was asked for."""


class CheckpointTargetError(ValueError):
    """The restore target does not match what was saved (shape, dtype, missing leaf)."""


class CheckpointFormatError(ValueError):
    """A step directory is not a checkpoint this version can read."""


class CheckpointCorruptError(OSError):
    """Stored bytes do not match their checksums, or a stored file is missing or truncated."""
