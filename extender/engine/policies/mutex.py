"""mutex: HAMi's GPU policy of that name. A container's vGPUs go only on GPUs no other vGPU holds at that moment
(the pod's own containers running beside it included), chosen as `topology` chooses among idle GPUs (the
best-connected set; a single GPU whose loss least breaks up well-connected idle sets). Later pods may still share
those GPUs unless they ask for gpucores 100, as in HAMi, where mutex only checks that a device is unused."""

from __future__ import annotations

from kube_vgpu.extender.engine.policies.topology import Topology


class Mutex(Topology):
    name = "mutex"
    only_idle_gpus = True
