"""The quota gate: Kueue-style ClusterQueue budgets enforced on the GPUs actually assigned (issue 6).

objects.py    Kueue's YAML (v1beta1 / v1beta2) -> validated objects; errors name the object and field
accounting.py pure quota arithmetic (Kueue's nominal / borrowingLimit / lendingLimit through cohorts)
gate.py       the Gate used by filter and bind, driven by ClusterState's usage listeners
live.py       list + watch of Kueue's objects (and namespaces) through the kubernetes client
cli.py        `kube-vgpu quota status`
"""
