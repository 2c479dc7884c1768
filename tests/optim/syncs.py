"""Count the ops that block the host on a GPU, on a CPU run (issue 45, item 4).

On CUDA these wait for the device: a scalar read (``item``, ``bool()``/``float()``/``int()`` of a
tensor: ``_local_scalar_dense``), ``tolist``, a tensor made from host data on the device
(``torch.tensor(list, device=...)``, ``new_tensor``: a pageable copy), every op whose output size
depends on the data (``unique``, ``unique_consecutive``, ``nonzero``, ``masked_select``,
``bincount``, indexing by a boolean mask, ``repeat_interleave`` without ``output_size``), an op
that answers a Python bool (``equal``, ``allclose``) and a copy to the host (``cpu``, ``numpy``,
``.to("cpu")``). On a CPU none of them waits, so a test cannot time them; it can count them.

:class:`SyncCounter` counts them at two levels, each op once:

* a ``TorchFunctionMode`` sees the Python-level calls (``Tensor.tolist``, ``Tensor.__bool__``,
  ``torch.tensor``, ``Tensor.__getitem__`` with a bool index...), which ``torch.profiler`` cannot
  see on a CPU;
* a ``TorchDispatchMode`` sees the aten ops below them, and so the syncs that C++ makes on its
  own (a ``repeat_interleave`` without ``output_size`` called from aten, a ``_local_scalar_dense``
  inside a kernel); an aten op under a Python-level call already counted is not counted again.

``host`` says which tensors live on the host even in a GPU run (``torch.optim``'s step counters,
read with ``.item()`` by its Adam; FBGEMM's ``iter_cpu``): reads of those are not syncs, and are
left out. So is a tensor made on the host by intent, ``device="cpu"`` spelled as a string
(``torch.optim``'s Adam makes one each step): on a CPU run every device is the CPU, so a device
*object* is counted, since on a GPU it would be the GPU's.

``staging`` names the host *staging* buffers (the pair counts :class:`~dlrm_vrgd.optim.sparse.
accumulate.GroupRows` stages, pinned on CUDA): a read of one is left out only when all of these
hold, and counted as its kind otherwise:

* ``staging(t)`` says it is one (an identity test on the buffer, made by the harness);
* its last fill was a ``copy_(src, non_blocking=True)`` that this counter saw (a blocking copy
  into it counts as ``copy_ to host`` and makes its reads count again);
* that fill was in an *earlier* region of this counter (an earlier ``with``: the harnesses
  enter it once per collect, a micro-batch's forward and backward between two).

That is when such a read does not stall the device's queue on CUDA: the copy was enqueued a
micro-batch before, so it has arrived unless the host ran more than a micro-batch ahead, and
even then the host waits for that copy's event, not for the work enqueued since (as a
``.item()``/``.tolist()`` of a device tensor would). A read in the same region as its fill, a
read of a buffer this counter never saw filled (the step's read of the last collect's counts:
its fill was another counter's) and every read of a device tensor still count.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

Tensor = torch.Tensor

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OURS = (os.path.join(_ROOT, "dlrm_vrgd"), os.path.join(_ROOT, "tests"))
_THIS = os.path.abspath(__file__)

#: Python-level calls on a tensor that read it back (the first argument is the tensor read).
_READS = {
    Tensor.item: "item",
    Tensor.__bool__: "bool()",
    Tensor.__float__: "float()",
    Tensor.__int__: "int()",
    Tensor.__index__: "index()",
    Tensor.tolist: "tolist",
    Tensor.cpu: "cpu",
    Tensor.numpy: "numpy",
}
_DATA_SIZED = {
    torch.unique: "unique",
    Tensor.unique: "unique",
    torch.unique_consecutive: "unique_consecutive",
    Tensor.unique_consecutive: "unique_consecutive",
    torch.nonzero: "nonzero",
    Tensor.nonzero: "nonzero",
    torch.argwhere: "nonzero",
    Tensor.argwhere: "nonzero",
    torch.masked_select: "masked_select",
    Tensor.masked_select: "masked_select",
    torch.bincount: "bincount",  # sized by the largest id: CUDA reads it back
    Tensor.bincount: "bincount",
    torch.equal: "equal",  # a Python bool
    Tensor.equal: "equal",
    torch.allclose: "allclose",
    Tensor.allclose: "allclose",
}
_ATEN = {
    "aten._local_scalar_dense.default": "_local_scalar_dense",
    "aten.nonzero.default": "nonzero",
    "aten._unique.default": "unique",
    "aten._unique2.default": "unique",
    "aten.unique_dim.default": "unique",
    "aten.unique_consecutive.default": "unique_consecutive",
    "aten.masked_select.default": "masked_select",
    "aten.bincount.default": "bincount",
    "aten.equal.default": "equal",
    "aten.allclose.default": "allclose",
}


def _is_host_string(device: Any) -> bool:
    """``device`` is the host spelled as a string (``"cpu"``): the host by intent."""
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``Tensor.to(...)`` asks for the host by name (``"cpu"``): a copy the host waits for."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return _is_host_string(target)


def _has_bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple | list) else (index,)
    return any(
        isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) and i.ndim > 0 for i in items
    )


def _caller() -> str:
    """``file:line`` of the innermost frame in this project (dlrm_vrgd/ or tests/)."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_OURS) and path != _THIS:
            return f"{os.path.relpath(path, _ROOT)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class SyncCounter:
    """Context manager: the sync-prone ops run inside it, by kind (:attr:`kinds`) and by kind
    and place (:attr:`where`). ``host(t)``: whether tensor ``t`` lives on the host on a GPU too."""

    def __init__(
        self,
        host: Callable[[Tensor], bool] | None = None,
        staging: Callable[[Tensor], bool] | None = None,
    ) -> None:
        self.host = host or (lambda t: False)
        self.staging = staging or (lambda t: False)
        self.kinds: collections.Counter[str] = collections.Counter()
        self.where: collections.Counter[tuple[str, str]] = collections.Counter()
        #: reads left out as staged (see the module doc), by place: for a test to see them
        self.staged_reads: collections.Counter[str] = collections.Counter()
        self._quiet = 0
        self._region = 0
        self._fills: dict[int, int] = {}  # staging storage -> region of its non-blocking fill
        self._fn = _FunctionCounter(self)
        self._dispatch = _DispatchCounter(self)

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def _count(self, kind: str) -> None:
        self.kinds[kind] += 1
        self.where[(kind, _caller())] += 1

    def _filled(self, dst: Tensor, non_blocking: bool) -> str | None:
        """A ``copy_`` into ``dst``: remembered if ``dst`` is a staging buffer."""
        if not self.staging(dst._base if dst._base is not None else dst):
            return None
        key = dst.untyped_storage().data_ptr()
        if non_blocking:
            self._fills[key] = self._region
            return None
        self._fills.pop(key, None)
        return "copy_ to host"

    def _staged_earlier(self, t: Tensor) -> bool:
        """``t`` is a staging buffer filled non-blocking in an earlier region (module doc)."""
        if not self.staging(t):
            return False
        region = self._fills.get(t.untyped_storage().data_ptr())
        if region is None or region >= self._region:
            return False
        self.staged_reads[_caller()] += 1
        return True

    def __enter__(self) -> SyncCounter:
        self._region += 1
        self._fn.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._dispatch.__exit__(*exc)
        self._fn.__exit__(*exc)


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, owner: SyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def _kind(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        first = args[0] if args else None
        if func in _READS:
            if isinstance(first, Tensor) and self.owner.host(first):
                return ""  # a host tensor: read, but no sync
            if isinstance(first, Tensor) and self.owner._staged_earlier(first):
                return ""  # a staging buffer filled a region before: see the module doc
            return _READS[func]
        if func is Tensor.copy_ and isinstance(first, Tensor):
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            return self.owner._filled(first, bool(non_blocking))
        if func in _DATA_SIZED:
            return _DATA_SIZED[func]
        if func is torch.where and len(args) + len(kwargs) == 1:
            return "nonzero"
        if func in (torch.tensor, torch.as_tensor):
            device = kwargs.get("device")
            if device is None or _is_host_string(device):
                return None  # made on the host
            return "tensor(data, device=)"
        if func is Tensor.to and _to_host(args, kwargs):
            if isinstance(first, Tensor) and self.owner.host(first):
                return ""
            return "to(cpu)"
        if func is Tensor.new_tensor:
            return "new_tensor"
        if func in (torch.repeat_interleave, Tensor.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats", first)
            if isinstance(repeats, Tensor) and kwargs.get("output_size") is None:
                return "repeat_interleave (no output_size)"
            return None
        if func in (Tensor.__getitem__, Tensor.__setitem__) and len(args) > 1:
            return "bool-mask index" if _has_bool_index(args[1]) else None
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        kind = self._kind(func, args, kwargs)
        if kind is None:
            return func(*args, **kwargs)
        if kind:
            self.owner._count(kind)
        self.owner._quiet += 1  # the aten ops below it are this one op
        try:
            return func(*args, **kwargs)
        finally:
            self.owner._quiet -= 1


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, owner: SyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if not self.owner._quiet:
            name = str(func)
            kind = _ATEN.get(name)
            if name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None:
                kind = "repeat_interleave (no output_size)"
            elif name in ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default"):
                kind = "bool-mask index" if _has_bool_index(args[1]) else None
            elif kind == "_local_scalar_dense" and self.owner.host(args[0]):
                kind = None
            if kind:
                self.owner._count(kind)
        return func(*args, **kwargs)


def count_syncs(fn: Callable[[], Any], host: Callable[[Tensor], bool] | None = None) -> SyncCounter:
    """Run ``fn()`` under a :class:`SyncCounter` and return the counter."""
    with SyncCounter(host) as counter:
        fn()
    return counter
