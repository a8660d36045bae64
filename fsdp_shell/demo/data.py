"""Real text with nothing to download: the running interpreter's standard-library sources, as bytes.

The corpus is every ``*.py`` file under ``sysconfig``'s ``stdlib`` path in sorted order, up to
``max_bytes``, tokenised byte-wise (vocabulary 256). The first 90 % is for training, the rest
held out. Batches are a pure function of (seed, step, micro-batch), so every rank, the
single-process reference and a resumed run draw the same global batches.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "load_corpus"]

VOCAB = 256


@dataclass(frozen=True)
class Corpus:
    """Train and held-out byte streams."""

    train: torch.Tensor
    held_out: torch.Tensor
    files: int

    def batch(
        self, *, seed: int, step: int, micro: int, rows: int, seq: int, held_out: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` sequences of ``seq`` input bytes and their next-byte targets."""
        data = self.held_out if held_out else self.train
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + micro + (7 if held_out else 0))
        starts = torch.randint(0, data.numel() - seq - 1, (rows,), generator=g)
        window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).long()
        return window[:, :-1], window[:, 1:]


def load_corpus(max_bytes: int = 4_000_000) -> Corpus:
    """Read the standard library's Python sources (deterministic order) into a ``Corpus``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = files = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            blob = path.read_bytes()
        except OSError:
            continue
        chunks.append(blob)
        total += len(blob)
        files += 1
        if total >= max_bytes:
            break
    if total < 100_000:
        raise RuntimeError(f"found only {total} bytes of standard-library source under {root}")
    data = torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)
    cut = int(data.numel() * 0.9)
    return Corpus(train=data[:cut].clone(), held_out=data[cut:].clone(), files=files)
