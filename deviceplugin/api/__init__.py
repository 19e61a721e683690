"""kubelet gRPC APIs (device plugin v1beta1, pod resources v1): our .proto files and the modules generated from
them by `python -m kube_vgpu.deviceplugin.api.generate`."""
