"""Exact live bytes of a rank's tensor storages, current and peak, by phase.

``LiveBytes`` is a ``TorchDispatchMode``: every storage an op creates or writes into while it is
active (on the thread that entered it; autograd's CPU backward runs on that thread too) is
counted from the op that makes it until it dies (a ``weakref.finalize`` on the storage), at its
size in bytes as it changes (``UntypedStorage.resize_`` is watched while the mode is active, so
FSDP's freeing and re-allocating of unsharded parameters is seen as it happens). The peak is
taken after every op. What it does not see: storages made by threads that never entered it
(gloo's own transport buffers, for one) and memory that is no tensor storage.

Phases are names the caller gives (``with live.phase("backward"):``); each keeps its own peak,
and time outside any named phase is counted under ``"other"``. Storages on other devices than
``device`` (``meta`` ones, say) are not counted, nor those of tensors given to ``ignore``. Under
``FakeTensorMode`` every fake tensor's storage is a ``meta`` one: ``LiveBytes("meta")`` inside the
fake mode counts what the same program would hold for real, with no memory behind it. With
``block`` each storage counts as a multiple of that many bytes (512: CUDA's caching allocator;
an empty storage counts 0). One mode per thread at a time; not re-entrant.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "Window"]

_OTHER = "other"


class Window:
    """The live bytes at a block's start and end and the highest in between (``LiveBytes.window``)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.peak = start
        self.end = start


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]  # TorchDispatchMode is unannotated in torch
    """Live tensor-storage bytes on ``device`` (module docstring). ``current``: now; ``peak``:
    the highest since entry; ``peaks``: the highest in each phase."""

    def __init__(self, device: torch.device | str = "cpu", *, block: int = 1) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode is unannotated in torch
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise ValueError(f"block: expected an int >= 1 (bytes), got {block!r}")
        self.device = torch.device(device)
        self.block = block
        self._ignored: set[int] = set()
        """``id`` of every storage never counted (``ignore``)."""
        self.current = 0
        self.peak = 0
        self.peaks: dict[str, int] = {}
        self._phase = _OTHER
        self._sizes: dict[int, int] = {}
        """By ``id`` of a live storage: the bytes counted for it."""
        self._lock = threading.RLock()
        """Reentrant: the garbage collector may run a storage's finalizer (``_died``) on this
        thread while ``resized`` holds it."""
        self._unpatch: Callable[[], None] | None = None
        self._windows: list[Window] = []

    # -- what the caller sees ------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the block's peak under ``name`` (the enclosing phase resumes after it)."""
        outer, self._phase = self._phase, name
        self._note()
        try:
            yield
        finally:
            self._phase = outer

    @contextlib.contextmanager
    def window(self) -> Iterator[Window]:
        """The block's own figures: live bytes at its start and end, and its peak."""
        w = self.open_window()
        try:
            yield w
        finally:
            self.close_window(w)

    def open_window(self) -> Window:
        """A window from now until ``close_window`` (``window`` for a block)."""
        w = Window(self.current)
        self._windows.append(w)
        return w

    def close_window(self, w: Window) -> None:
        """End ``w``: its ``end`` is now, its ``peak`` the highest since it was opened."""
        self._windows.remove(w)
        w.end = self.current

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count ``tensors``' storages (made before the mode was entered, and kept alive by
        the caller while it is active)."""
        for t in tensors:
            self._ignored.add(id(t.untyped_storage()))

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors``' storages too (made before the mode was entered)."""
        for t in tensors:
            self._see(t)
        self._note()

    @property
    def current_phase(self) -> str:
        """The phase counted now (``"other"`` outside any)."""
        return self._phase

    # -- the mode ------------------------------------------------------------------------------

    def __enter__(self) -> LiveBytes:
        self._unpatch = _watch_resizes(self)
        super().__enter__()  # type: ignore[no-untyped-call]  # TorchDispatchMode is unannotated in torch
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        super().__exit__(kind, value, tb)  # type: ignore[no-untyped-call]  # TorchDispatchMode is unannotated in torch
        if self._unpatch is not None:
            self._unpatch()
            self._unpatch = None

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: object,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        out = func(*args, **(kwargs or {}))
        for leaf in (*tree_leaves(out), *tree_leaves(args)):
            if isinstance(leaf, torch.Tensor):
                self._see(leaf)
        self._note()
        return out

    # -- bookkeeping ---------------------------------------------------------------------------

    def _see(self, t: torch.Tensor) -> None:
        wrapper: object = t  # the TypeGuard makes a Tensor one unreachable to mypy
        if is_traceable_wrapper_subclass(wrapper):
            # a DTensor's own storage is a placeholder of the global size, no memory: its local
            # tensor's is what it holds
            attrs, _ = wrapper.__tensor_flatten__()
            for name in attrs:
                inner = getattr(wrapper, name)
                if isinstance(inner, torch.Tensor):
                    self._see(inner)
            return
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # a tensor without storage (sparse, subclasses)
            return
        self.resized(storage)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` may be new or of a new size: count it at its size now."""
        if storage.device != self.device:
            return
        key = id(storage)
        if key in self._ignored:
            return
        nbytes = -(-storage.nbytes() // self.block) * self.block
        with self._lock:
            before = self._sizes.get(key)
            if before is None:
                weakref.finalize(storage, self._died, key)
            self._sizes[key] = nbytes
            self.current += nbytes - (before or 0)

    def _died(self, key: int) -> None:
        with self._lock:
            self.current -= self._sizes.pop(key, 0)

    def _note(self) -> None:
        current = self.current
        if current > self.peak:
            self.peak = current
        if current > self.peaks.get(self._phase, -1):
            self.peaks[self._phase] = current
        for w in self._windows:
            if current > w.peak:
                w.peak = current


_watching: list[LiveBytes] = []
_original_resize = torch.UntypedStorage.resize_


def _resize_watched(self: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    result: torch.UntypedStorage = _original_resize(self, size)
    for watcher in _watching:
        watcher.resized(self)
        watcher._note()
    return result


def _watch_resizes(live: LiveBytes) -> Callable[[], None]:
    """While ``live`` is active, ``UntypedStorage.resize_`` tells it the new size."""
    if not _watching:
        torch.UntypedStorage.resize_ = _resize_watched  # type: ignore[method-assign,assignment]  # put back by the undo
    _watching.append(live)

    def undo() -> None:
        _watching.remove(live)
        if not _watching:
            torch.UntypedStorage.resize_ = _original_resize  # type: ignore[method-assign]  # the original

    return undo
