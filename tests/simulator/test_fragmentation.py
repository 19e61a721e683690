"""The FGD fragmentation measure against hand-computed small cases."""

from __future__ import annotations

import pytest

from kube_vgpu.extender.engine.fragmentation import FragModel, ShapeLearner, TaskShape, frag_of, typical_shapes

SHARE = TaskShape(cpu_milli=1000, gpu_milli=500, gpu_count=1)
WHOLE = TaskShape(cpu_milli=1000, gpu_milli=1000, gpu_count=1)
CPU_ONLY = TaskShape(cpu_milli=2000, gpu_milli=0, gpu_count=0)
TWO_GPUS = TaskShape(cpu_milli=1000, gpu_milli=1000, gpu_count=2)
MIXED = ((SHARE, 0.5), (WHOLE, 0.3), (CPU_ONLY, 0.2))


@pytest.mark.parametrize(
    ("case", "cpu_free", "gpu_free", "shapes", "expected"),
    [
        # share fits, 300 left on the other GPU is too small for it and for a whole GPU: 0.5*300 + 0.3*300;
        # CPU-only tasks can never use GPU capacity: 0.2 * 1300
        ("partly fragmented", 4000, (1000, 300), MIXED, 0.5 * 300 + 0.3 * 300 + 0.2 * 1300),
        ("no CPU left: everything idle counts", 500, (1000, 300), MIXED, 1300),
        ("no GPU big enough", 4000, (300, 300), MIXED, 0.5 * 600 + 0.3 * 600 + 0.2 * 600),
        ("nothing idle", 4000, (0, 0), MIXED, 0),
        ("wrong model", 4000, (1000, 1000), ((TaskShape(1000, 500, 1, ("V100M16",)), 1.0),), 2000),
        ("allowed model", 4000, (1000, 1000), ((TaskShape(1000, 500, 1, ("T4", "P100")), 1.0),), 0),
        ("2-GPU task fits, the half GPU does not help it", 4000, (1000, 1000, 500), ((TWO_GPUS, 1.0),), 500),
        ("2-GPU task does not fit: all idle", 4000, (1000, 500, 500), ((TWO_GPUS, 1.0),), 2000),
        ("order of GPUs does not matter", 4000, (300, 1000), MIXED, 0.5 * 300 + 0.3 * 300 + 0.2 * 1300),
    ],
)
def test_node_fragmentation(case, cpu_free, gpu_free, shapes, expected):
    assert frag_of("T4", cpu_free, gpu_free, shapes) == pytest.approx(expected), case


def test_memoised_value_matches_direct_computation():
    model = FragModel(MIXED)
    first = model.frag("T4", 4000, (1000, 300))
    again = model.frag("T4", 4000, (1000, 300))
    assert first == again == pytest.approx(500)


def test_typical_shapes_cover_and_renormalise():
    a, b, c, d = (TaskShape(1000 * i, 100, 1) for i in range(1, 5))
    shapes = [a] * 5 + [b] * 3 + [c] + [d]
    assert typical_shapes(shapes, coverage=0.8) == ((a, 5 / 8), (b, 3 / 8))
    # equal counts: the larger shape first (the reference's order), and only as many as needed
    assert typical_shapes(shapes, coverage=0.9) == ((a, 5 / 9), (b, 3 / 9), (d, 1 / 9))
    assert sum(p for _, p in typical_shapes(shapes)) == pytest.approx(1.0)
    assert typical_shapes([]) == ()


def test_learner_refreshes_at_doubling_counts():
    learner = ShapeLearner(refresh_tasks=16)
    refreshes = [n for n in range(1, 80) if learner.add(SHARE)]
    assert refreshes == [1, 8, 16, 32, 48, 64]
    assert learner.shapes() == ((SHARE, 1.0),)
