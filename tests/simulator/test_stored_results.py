"""The committed simulator results (bench/results/openb/<trace>/<policy>/<seed>.json, written by
`bench/simulate_openb.py --results bench/results/openb`) still come out of the code: a slice of them is re-run and
must match exactly, every number and the whole allocated curve. A change that moves a published number fails here;
regenerate the results (docs/simulator.md, "Results") and commit them with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kube_vgpu.dev.simulator.runner import Job, run_experiment, stored_path
from kube_vgpu.dev.simulator.trace import find_openb_traces

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "openb"


TRACES = find_openb_traces()


@pytest.mark.skipif(TRACES is None, reason="openb traces not found (set KUBE_VGPU_OPENB_TRACES)")
@pytest.mark.parametrize(("policy", "seed"), [("bfgd", 42), ("bfgd", 43), ("fgd", 42), ("fgd", 43), ("hsafgd", 42)])
def test_rerun_matches_stored(policy: str, seed: int) -> None:
    assert TRACES is not None
    job = Job(str(TRACES / "openb_node_list_gpu_node.csv"), str(TRACES / "openb_pod_list_default.csv"), policy, seed)
    stored = json.loads(stored_path(RESULTS, job).read_text())
    assert run_experiment(job).to_json() == stored


def test_stored_set_is_complete() -> None:
    """Every trace has fgd, both bfgd variants and hsafgd (issue 19's bar) on the ten seeds of the table."""
    for trace in ("default", "cpu100", "gpushare40", "gpuspec20", "multigpu30"):
        for policy in ("fgd", "bfgd", "bfgd-ref", "hsafgd"):
            seeds = sorted(int(path.stem) for path in (RESULTS / trace / policy).glob("*.json"))
            assert seeds == list(range(42, 52)), (trace, policy)
