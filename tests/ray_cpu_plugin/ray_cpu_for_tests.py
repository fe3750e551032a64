"""Let vLLM's CPU platform run its Ray executor, for tests on machines without a GPU.

vLLM's CPU platform has no Ray device key (``ray_device_key == ""``): both Ray executors refuse
it ("current platform cpu does not support ray"). Two changes are enough:

1. ``CpuPlatform.ray_device_key = RESOURCE``: the executor asks Ray for one ``RESOURCE`` per
   worker (placement-group bundles and actors). Ray reserves "CPU" and "GPU", so it is a custom
   resource, which the Ray cluster must declare where it starts
   (``ray start --head --resources '{"cpu_worker": 2}'``).
2. Each Ray worker looks up the device ids Ray gave it, ``get_accelerator_ids()[ray_device_key]``,
   where Ray lists only the accelerators it knows. A CPU worker has none: the custom resource is
   listed with no ids.

Why ``vllm.platform_plugins`` and not ``vllm.general_plugins``: a Ray worker asks for its device
ids before it loads general plugins (in ``init_worker``), whereas platform plugins are consulted
in every process the first time it resolves ``current_platform`` (in a Ray worker: when it
imports the executor module). ``register`` returns None, so vLLM still detects and uses its own
CPU platform. Not consulted when ``VLLM_TARGET_DEVICE=cpu`` is set.
"""

import sys

RESOURCE = "cpu_worker"


def register() -> None:
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.ray_device_key = RESOURCE
    if "ray" in sys.modules:  # a Ray worker (it imports ray first); other processes skip the import
        _list_resource_without_ids()
    return None


def _list_resource_without_ids() -> None:
    from ray.runtime_context import RuntimeContext

    original = RuntimeContext.get_accelerator_ids

    def get_accelerator_ids(self) -> dict[str, list[str]]:
        return {**original(self), RESOURCE: []}

    RuntimeContext.get_accelerator_ids = get_accelerator_ids
