"""The sizes a memory's files depend on (``ModelShape``): the layers that keep a memory, their
key/value heads and head dim, and the layout of a block's rows (its tokens, and its landmark
last where landmarks close the blocks)."""

from dataclasses import dataclass

from ..core.layout import landmarked_length
from ..storage import stored_nbytes


@dataclass(frozen=True)
class ModelShape:
    """The sizes a memory's files depend on.

    n_layer : layers that keep a memory (every layer of the model, unless ``windows`` says).
    windows : per layer of the model, 0 for one that keeps a memory, else the positions a
        sliding-window layer attends to (it keeps only them, in the state file: Gemma 3's local
        layers); empty when every layer keeps a memory.
    """

    n_layer: int
    n_kv_head: int
    head_dim: int
    block_size: int
    windows: tuple[int, ...] = ()
    landmarks: bool = True  # a landmark closes every block (``MemoryOptions.block_keys``)

    @property
    def rows(self) -> int:
        """Rows of one block: its tokens, and its landmark last where there is one."""
        return self.block_size + self.landmarks

    def rows_of(self, n_normal: int) -> int:
        """Rows of ``n_normal`` tokens from a block boundary on, landmarks included."""
        return landmarked_length(n_normal, self.block_size) if self.landmarks else n_normal

    @property
    def key_row(self) -> int:
        """The row whose position a block's block key is scored at: its landmark's, or its first
        (the mean of its tokens' keys rotated to their offsets)."""
        return self.block_size if self.landmarks else 0

    @property
    def memory_layers(self) -> list[int]:
        """The model's layers that keep a memory, in order (memory layer ``i`` is model layer
        ``memory_layers[i]``)."""
        return [layer for layer, w in enumerate(self.windows) if not w] if self.windows else list(range(self.n_layer))

    @property
    def window_layers(self) -> dict[int, int]:
        """``{model layer: window}`` of the layers that keep no memory."""
        return {layer: w for layer, w in enumerate(self.windows) if w}

    @property
    def block_entry(self) -> tuple[int, int, int, int]:
        """Shape of one stored block of one layer: keys and values, (2, H_kv, rows, D)."""
        return (2, self.n_kv_head, self.rows, self.head_dim)

    def block_bytes(self, store_dtype: str) -> int:
        """Stored bytes of one block of one stream, all layers, in a store of ``store_dtype``."""
        return self.n_layer * stored_nbytes(self.block_entry, store_dtype)
