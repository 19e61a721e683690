"""manifests/components/dynamic-mig: what it changes in the device plugin DaemonSet, and nothing else.

The overlay manifests/overlays/dynamic-mig is the self-signed overlay plus the component; the API server's own
validation of it (privileged needs allowPrivilegeEscalation) runs in tests/e2e/test_manifests_apply.py.
"""

from __future__ import annotations

from typing import Any

from kube_vgpu.deviceplugin.dynmig import parse_profiles
from kube_vgpu.protocol import mig
from tests.manifests.render import one, render

DAEMONSET = "kube-vgpu-device-plugin"
PROFILES_FLAG = "--dynamic-mig-profiles="


def plugin_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = one(objects, "DaemonSet", DAEMONSET)["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "device-plugin")


def test_only_the_device_plugin_container_changes() -> None:
    plain, dynamic = render("overlays/self-signed"), render("overlays/dynamic-mig")
    key = lambda o: (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, plain)) == sorted(map(key, dynamic))
    by_key = {key(o): o for o in plain}
    for obj in dynamic:
        if key(obj) != ("DaemonSet", "kube-vgpu", DAEMONSET):
            assert obj == by_key[key(obj)], key(obj)
    before, after = plugin_container(plain), plugin_container(dynamic)
    changed = {field for field in before.keys() | after.keys() if before.get(field) != after.get(field)}
    assert changed == {"args", "env", "securityContext"}
    assert after["args"][:-1] == before["args"] and after["args"][-1].startswith(PROFILES_FLAG)
    assert after["env"] == [*before["env"], {"name": "NVIDIA_MIG_CONFIG_DEVICES", "value": "all"}]


def test_the_plugin_is_privileged_without_a_misleading_drop_list() -> None:
    security = plugin_container(render("overlays/dynamic-mig"))["securityContext"]
    assert security["privileged"] is True
    assert security["allowPrivilegeEscalation"] is True  # the API server refuses privileged without it
    assert "capabilities" not in security  # a privileged container has every capability whatever it drops
    assert security["readOnlyRootFilesystem"] is True and security["runAsUser"] == 0


def test_no_gpu_list_flag_so_the_node_label_decides() -> None:
    args = plugin_container(render("overlays/dynamic-mig"))["args"]
    assert not any(a == "--dynamic-mig" or a.startswith("--dynamic-mig=") for a in args)


def test_the_allowlist_parses_and_holds_every_placeable_profile_of_every_tabled_model() -> None:
    flag = plugin_container(render("overlays/dynamic-mig"))["args"][-1]
    allow = parse_profiles(flag.removeprefix(PROFILES_FLAG))
    assert allow == {m.key: tuple(p.name for p in m.profiles if not p.name.endswith("+me")) for m in mig.MIG_MODELS}
