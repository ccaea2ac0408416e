"""The errors a memory's files raise (``manifest`` and the document list share them), and the
line that names a memory's model against another."""


class MemoryFileError(ValueError):
    """A memory directory that cannot be opened as asked; the message says why and what to do."""


class WriterBusyError(MemoryFileError):
    """A memory another process is writing (it holds the writer lock)."""


class NoMemoryError(MemoryFileError):
    """No memory where one was named (its directory does not exist): nothing to call damaged."""


def shown(x) -> str:
    """``x`` as text on one line: as it is, or escaped (its ``repr``) where it holds what a line
    cannot (a manifest's name of a model, which anyone may have written)."""
    return str(x) if str(x).isprintable() else repr(str(x))


def wrong_model(path, saved, given: str) -> str:
    """One line: which model built the memory at ``path`` (``saved``, its manifest's
    ``ModelRecord``), which was given, what to pass (the manifest's name and weights ``shown``)."""
    name, weights = shown(saved.name), shown(saved.fingerprint[:12])
    built = f"{name} (weights {weights})" if saved.name else f"weights {weights}"
    mine = f"--model {given}" if given else "the model given"
    fix = f"pass --model {name}" if saved.name else "open it with the model that built it"
    return f"the memory {path} was built with another model, {built}, not with {mine}: {fix}"
