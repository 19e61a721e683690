"""The policy registry is explicit and complete: every concrete policy class of the package is listed by its name."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from kube_vgpu.extender.engine import policies
from kube_vgpu.extender.engine.policies import REGISTRY, Policy, make_policy, policy_names


def concrete_policies() -> set[type[Policy]]:
    found: set[type[Policy]] = set()
    for module_info in pkgutil.iter_modules(policies.__path__):
        module = importlib.import_module(f"{policies.__name__}.{module_info.name}")
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, Policy) and value.name and value.__module__ == module.__name__:
                found.add(value)
    return found


def test_every_named_policy_class_is_in_the_registry_under_its_name() -> None:
    assert set(REGISTRY.values()) == concrete_policies()
    assert all(REGISTRY[cls.name] is cls for cls in concrete_policies())


def test_make_policy_names_the_known_policies_when_asked_for_an_unknown_one() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'nope'; known policies: .*bfgd"):
        make_policy("nope")
    assert policy_names() == sorted(REGISTRY)


def test_the_registry_cannot_be_changed_behind_the_scheduler() -> None:
    with pytest.raises(TypeError):
        REGISTRY["x"] = Policy  # type: ignore[index]
