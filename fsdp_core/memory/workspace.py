"""Device memory that the CUDA math libraries take from the caching allocator and keep.

PyTorch gives cuBLAS a workspace from the caching allocator for each pair of a cuBLAS handle
(one per thread) and a stream that multiplies matrices, and keeps it for the life of the
process, so ``torch.cuda.memory_allocated`` counts it. A training step multiplies on two
threads: the forward on the caller's, the backward on autograd's device thread, both on the
compute stream. cuBLASLt (``addmm``: ``nn.Linear`` with a bias) takes one more, smaller workspace.

Measured on an H200 with torch 2.11 (a fresh process, ``memory_allocated`` around each first
call): 32 MiB after the first ``mm``, 1 MiB more after the first ``addmm``, 32 MiB more after
the first backward, 32 MiB more for an ``mm`` on another stream. The sizes are torch's defaults
(its ``CublasHandlePool.cpp``): cuBLAS 32 MiB on compute capability 9.0 and 8 MiB + 128 KiB on
others, or the sum of ``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE:COUNT`` pairs (KiB); cuBLASLt
``CUBLASLT_WORKSPACE_SIZE`` KiB, 1024 by default.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Workspaces", "cuda_workspaces"]

KIB = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class Workspaces:
    """The math libraries' workspaces on one device, in bytes."""

    cublas: int
    """One cuBLAS workspace (one per thread and stream that multiplies)."""
    cublaslt: int
    """cuBLASLt's workspace (one: the forward's fused-bias ``addmm``)."""
    threads: int = 2
    """Threads that multiply on the compute stream: the forward's and autograd's."""

    def __post_init__(self) -> None:
        for name in ("cublas", "cublaslt", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {value!r}")

    @property
    def bytes(self) -> int:
        """What they hold together once a training step has run."""
        return self.threads * self.cublas + self.cublaslt


def cuda_workspaces(capability: tuple[int, int], env: Mapping[str, str]) -> Workspaces:
    """torch's workspace sizes for a GPU of compute ``capability`` (``(9, 0)``: H100, H200)
    under the environment variables ``env``. ``ValueError`` for a malformed variable, as torch
    would warn and fall back where this cannot know what the user meant."""
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        cublas = 4096 * 8 * KIB if capability == (9, 0) else 4096 * KIB * 2 + 16 * KIB * 8
    else:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if not pairs:
            raise ValueError(f"CUBLAS_WORKSPACE_CONFIG: expected ':SIZE:COUNT' pairs (KiB), got {config!r}")
        cublas = sum(int(size) * KIB * int(count) for size, count in pairs)
    lt = env.get("CUBLASLT_WORKSPACE_SIZE", "1024")
    if not lt.isdigit():
        raise ValueError(f"CUBLASLT_WORKSPACE_SIZE: expected a whole number of KiB, got {lt!r}")
    return Workspaces(cublas=cublas, cublaslt=int(lt) * KIB)
