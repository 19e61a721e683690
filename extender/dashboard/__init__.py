"""`kube-vgpu dashboard`: a read-only web page over the extender's own live state (GET /state, GET /quota), for
platform engineers: capacity and allocation, nodes and their GPUs, pods, queues. docs/dashboard.md."""
