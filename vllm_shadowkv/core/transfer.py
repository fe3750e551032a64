"""Host-to-device copies of fetched values on a dedicated stream, overlapping the key rebuild,
and device-to-host copies of small index tensors that are read later (``HostCopy``).

The decode step queues the key rebuild on the compute stream first, then gathers the missed
value rows on the host (into pinned memory) and copies them on the copy stream; the compute
stream waits for the copy only where the values are scattered into their slots. On the CPU
everything is synchronous and nothing moves. The CUDA lines are checked by
test_cuda_decode_from_pinned_store_matches_cpu and test_paged_sparse_decode_on_cuda_matches_cpu
(scripts/gpu_checks.sh); the CPU path of the same calls by every decode test.
"""

import torch

_copy_streams: dict[torch.device, "torch.cuda.Stream"] = {}


def host_staging(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A host buffer of `like`'s dtype to gather into: pinned when `like` is on CUDA, so that
    the copy is asynchronous (torch's pinned allocator holds it until the copy is done)."""
    return torch.empty(shape, dtype=like.dtype, pin_memory=like.is_cuda)


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`. To CUDA: copied on this device's copy stream; the current stream
    waits for it, so work queued on the current stream before this call overlaps the copy."""
    if device.type != "cuda":
        return host if host.device == device else host.to(device)
    if not host.is_pinned():  # (from pageable memory the copy would make the host wait)
        host = host.pin_memory()
    compute = torch.cuda.current_stream(device)
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        out = host.to(device, non_blocking=True)
    compute.wait_stream(stream)
    out.record_stream(compute)  # allocated on the copy stream, consumed on the compute stream
    return out


class HostCopy:
    """Tensors copied to the host without waiting: on CUDA into pinned memory behind an event
    (``wait`` blocks only if the copy is not done yet), elsewhere at once."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._ready = None
        if tensors and tensors[0].is_cuda:
            self.tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, t in zip(self.tensors, tensors):
                host.copy_(t, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self.tensors = [t.cpu() for t in tensors]

    def wait(self) -> list[torch.Tensor]:
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self.tensors
