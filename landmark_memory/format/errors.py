"""The errors a memory's files raise (``manifest`` and the document list share them)."""


class MemoryFileError(ValueError):
    """A memory directory that cannot be opened as asked; the message says why and what to do."""


class WriterBusyError(MemoryFileError):
    """A memory another process is writing (it holds the writer lock)."""


class NoMemoryError(MemoryFileError):
    """No memory where one was named (its directory does not exist): nothing to call damaged."""
