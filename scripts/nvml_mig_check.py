"""Read-only NVML checks of kube-vgpu's MIG code paths on a real GPU: nothing is created, nothing is changed.

Run from the repository root on a GPU machine: `python3 scripts/nvml_mig_check.py`. It loads protocol/mig.py and
deviceplugin/nvml.py by path (pynvml is the only dependency: from the environment, or nvidia-ml-py's pynvml.py copied
beside this script on a bare machine), reads every GPU instance profile NVML offers, and compares the placements
kube-vgpu's Nvml.possible_placements reads (the ctypes path dynamic MIG uses) with the tables. Prints the findings as
JSON, then ALL PLACEMENTS MATCH THE TABLE (exit 0) or MISMATCH (exit 1).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.append(str(Path(__file__).parent))
import pynvml


def load(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def profile_rows(nvml: Any, handle: Any, model: Any) -> list[dict[str, Any]]:
    rows = []
    for profile in model.profiles:
        row: dict[str, Any] = {"profile": profile.name, "table_id": profile.profile_id,
                               "table_starts": list(profile.starts), "table_size": profile.memory_slices}
        try:
            read = nvml.possible_placements(handle, profile.profile_id)
        except Exception as exc:  # reported, not raised: the report lists every profile
            read = f"{type(exc).__name__}: {exc}"
        row["placements_via_kube_vgpu"] = read
        row["matches_table"] = isinstance(read, list) and sorted(read) == sorted(
            (start, profile.memory_slices) for start in profile.starts)
        rows.append(row)
    return rows


def offered_profiles(handle: Any) -> list[dict[str, int]]:
    """Every GPU instance profile NVML offers on this GPU, by profile index, with its ID."""
    offered = []
    for profile_index in range(16):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_index)
        except pynvml.NVMLError:
            continue
        offered.append({"index": profile_index, "id": info.id, "slices": info.sliceCount,
                        "memory_mib": info.memorySizeMB, "instances": info.instanceCount,
                        "sms": info.multiprocessorCount})
    return offered


def main() -> int:
    mig = load("kube_vgpu_mig_tables", "kube_vgpu/protocol/mig.py")
    nvml = load("kube_vgpu_nvml", "deviceplugin/nvml.py").Nvml(pynvml)
    pynvml.nvmlInit()
    report: dict[str, Any] = {"driver": pynvml.nvmlSystemGetDriverVersion(), "gpus": []}
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        memory_mib = pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1 << 20)
        model = mig.mig_model(name, memory_mib)
        try:
            mode: Any = list(pynvml.nvmlDeviceGetMigMode(handle))
        except pynvml.NVMLError as exc:
            mode = str(exc)
        report["gpus"].append({
            "index": index, "name": name, "memory_mib": memory_mib, "mig_mode": mode,
            "model": model.key if model else None,
            "profiles": profile_rows(nvml, handle, model) if model else [],
            "nvml_profiles": offered_profiles(handle),
        })
    print(json.dumps(report, indent=1))
    ok = all(row["matches_table"] for gpu in report["gpus"] for row in gpu["profiles"])
    print("ALL PLACEMENTS MATCH THE TABLE" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
