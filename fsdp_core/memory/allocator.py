"""How a device's allocator sizes the memory of one tensor storage."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CUDA_CACHING", "EXACT", "Allocator"]


@dataclass(frozen=True, slots=True)
class Allocator:
    """A storage of ``n > 0`` bytes takes ``n`` rounded up to a multiple of ``block`` bytes; an
    empty one takes none. ``EXACT`` (``block=1``) counts bytes as the tensors hold them (the CPU);
    ``CUDA_CACHING`` as CUDA's caching allocator counts allocated bytes (blocks of 512 bytes,
    ``torch.cuda.max_memory_allocated``)."""

    block: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ValueError(f"block: expected an int >= 1 (bytes), got {self.block!r}")

    def size(self, nbytes: int) -> int:
        """The bytes a storage of ``nbytes`` takes."""
        return -(-nbytes // self.block) * self.block


EXACT = Allocator()
CUDA_CACHING = Allocator(512)
