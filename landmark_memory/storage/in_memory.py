"""The ``memory`` store: blocks in a dict in their stored form, nothing on disk."""

from .base import BlockStore, Stored


class MemoryStore(BlockStore):
    """Blocks in a dict, in their stored form: no serialisation."""

    def __init__(self, shape, store_dtype="float16"):
        super().__init__(shape, store_dtype)
        self._data: dict[tuple[int, int, int], Stored] = {}

    def put(self, items):
        self._data.update(self._stored(items))

    def keep(self, items: dict[tuple[int, int, int], Stored]) -> None:
        """Take blocks already in their stored form (another store's ``read_stored``), as they are."""
        self._data.update(items)

    def read_stored(self, keys):
        missing = [k for k in keys if k not in self._data]
        if missing:
            raise KeyError(f"blocks {missing[:3]} missing in the store")
        return [self._data[k] for k in keys]
