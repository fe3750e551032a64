"""Where the code under test would make the host wait for a GPU, counted on the CPU.

On CUDA the host waits whenever it reads a device tensor's values (``item``, ``int()``,
``tolist``, ``.cpu()``) or runs an op whose output size depends on the data (``nonzero``, a
boolean index, ``masked_select``, ``repeat_interleave`` by a tensor). On the CPU nothing waits,
so a decode path can grow such reads unnoticed. ``HostWaits`` counts them in the package's own
code (not in torch's or Triton's): what a ``transfer.HostCopy`` brought back, tensors made
without a device (host memory on a GPU machine too), and everything computed from them, are
host data and not counted (``transfer.to_device_async`` makes device data of it); the copies
themselves are counted apart. The host store's code works on host data by design and code that runs only for CPU tensors is
left out (``EXEMPT``).
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import vllm_shadowkv
import vllm_shadowkv.triton_kernels
from vllm_shadowkv.core import transfer

aten = torch.ops.aten
OURS = tuple(str(Path(m.__file__).parent) for m in (vllm_shadowkv, vllm_shadowkv.triton_kernels))
TORCH = str(Path(torch.__file__).parent)
HERE = __file__
# (file suffix, function): host-side by design, or a branch taken for CPU tensors only.
EXEMPT = (("store/value_store.py", None), ("core/store.py", None), ("core/transfer.py", None),
          ("core/cpu_kernels.py", None),
          ("core/attention.py", "attention_with_lse"))  # CUDA runs the reference, also counted
DATA_DEPENDENT = (aten._local_scalar_dense.default, aten.nonzero.default,
                  aten.masked_select.default)


def _caller() -> tuple[str, str, int] | None:
    """The innermost frame outside torch and this module: (file, function, line)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(TORCH) and name != HERE:
            return name, frame.f_code.co_name, frame.f_lineno
        frame = frame.f_back
    return None


def _counted(where) -> bool:
    if where is None or not where[0].startswith(OURS):
        return False
    return not any(where[0].endswith(suffix) and (fn is None or fn == where[1])
                   for suffix, fn in EXEMPT)


class HostWaits(TorchDispatchMode):
    """``with HostWaits() as waits: ...`` -> ``waits.reads`` (file:line of each read of device
    data) and ``waits.copies`` (HostCopy round trips)."""

    def __init__(self) -> None:
        super().__init__()
        self._host: dict[int, weakref.ref] = {}  # (tensors compare elementwise: by id)
        self.reads: list[str] = []
        self.copies = 0
        self.reading = False  # inside a counted read
        self._saved: list[tuple[object, str, object]] = []

    def is_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def mark_host(self, tensor: torch.Tensor) -> None:
        self._host[id(tensor)] = weakref.ref(tensor)

    def _read(self, where) -> None:
        if _counted(where):
            self.reads.append(f"{Path(where[0]).name}:{where[2]} ({where[1]})")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        host = any(self.is_host(t) for t in tensors)
        boolean_index = (func in (aten.index.Tensor, aten.index_put_.default,
                                  aten.index_put.default)
                         and any(i is not None and i.dtype == torch.bool for i in args[1]))
        sized_by_data = (func is aten.repeat_interleave.Tensor  # (unless told its size)
                         and (kwargs or {}).get("output_size") is None)
        if (not host and not self.reading
                and (func in DATA_DEPENDENT or boolean_index or sized_by_data)):
            self._read(_caller())
        out = func(*args, **(kwargs or {}))
        if host:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.mark_host(t)
        return out

    def __enter__(self):
        mode = self

        def wrap_read(name):
            original = getattr(torch.Tensor, name)

            def read(tensor, *args, **kwargs):
                if mode.reading or mode.is_host(tensor):
                    return original(tensor, *args, **kwargs)
                mode._read(_caller())
                mode.reading = True  # (int() reaches the dispatcher too: count it once)
                try:
                    return original(tensor, *args, **kwargs)
                finally:
                    mode.reading = False
            self._saved.append((torch.Tensor, name, original))
            setattr(torch.Tensor, name, read)

        # (on the CPU these never reach the dispatcher, nor does a scalar read)
        for name in ("tolist", "cpu", "numpy", "item", "__int__", "__float__", "__bool__",
                     "__index__"):
            wrap_read(name)

        def wrap_factory(name):
            original = getattr(torch, name)

            def make(*args, **kwargs):
                out = original(*args, **kwargs)
                if kwargs.get("device") is None:  # host memory on a CUDA machine too
                    mode.mark_host(out)
                return out
            self._saved.append((torch, name, original))
            setattr(torch, name, make)

        for name in ("tensor", "arange", "zeros", "ones", "empty", "full"):
            wrap_factory(name)
        original_wait = transfer.HostCopy.wait

        def wait(copy):
            mode.copies += 1
            # Copies, as on CUDA (on the CPU a HostCopy hands back the tensors themselves).
            tensors = [t.clone() for t in original_wait(copy)]
            for t in tensors:
                mode.mark_host(t)
            return tensors
        self._saved.append((transfer.HostCopy, "wait", original_wait))
        transfer.HostCopy.wait = wait
        original_to_device = transfer.to_device_async

        def to_device(host, device):
            out = original_to_device(host, device).clone()  # device data, as on CUDA
            mode._host.pop(id(out), None)
            return out
        self._saved.append((transfer, "to_device_async", original_to_device))
        transfer.to_device_async = to_device
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        return super().__exit__(*exc)


class CudaHostWaits:
    """The same count on a GPU, by CUDA itself: torch's sync debug mode raises at any op that
    makes the host wait, except inside ``HostCopy.wait`` (counted in ``copies``)."""

    def __init__(self) -> None:
        self.reads: list[str] = []  # (a wait raises instead)
        self.copies = 0

    def __enter__(self):
        original_wait = self._original_wait = transfer.HostCopy.wait

        def wait(copy):
            self.copies += 1
            torch.cuda.set_sync_debug_mode(0)
            try:
                return original_wait(copy)
            finally:
                torch.cuda.set_sync_debug_mode("error")
        transfer.HostCopy.wait = wait
        torch.cuda.set_sync_debug_mode("error")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)
        transfer.HostCopy.wait = self._original_wait
        return False
