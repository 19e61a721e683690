"""Issue 20 item 3: the inventory and assignment codecs raise ProtocolError, and nothing else, whatever JSON sits in
whatever field; what they accept is safe to build a node from. Hypothesis replaces, deletes and adds fields of
real annotations, and throws arbitrary JSON and text at the decoders."""

from __future__ import annotations

import copy
import re
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kube_vgpu import protocol
from kube_vgpu.dev.fixtures import TOPOLOGIES, synth_inventory
from kube_vgpu.extender.engine.model import NodeState
from kube_vgpu.extender.state import usage_from_assignment

A100_NODE = synth_inventory("n1", 4, "NVIDIA-A100-SXM4-80GB", 81920, "nvswitch")
INVENTORY = orjson.loads(protocol.encode_inventory(A100_NODE))
ASSIGNMENT = orjson.loads(
    protocol.encode_assignment(
        protocol.PodAssignment(
            node="n1",
            containers=(
                protocol.ContainerAssignment("init", (protocol.DeviceShare("GPU-a", 1000, 10),), init=True),
                protocol.ContainerAssignment(
                    "main", (protocol.DeviceShare("GPU-a", 2000, 20), protocol.DeviceShare("GPU-b", 2000, 20))
                ),
            ),
        )
    )
)

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=12,
)
# values near the edges of what each field accepts
EDGE_VALUES = st.sampled_from(
    [None, True, False, 0, -1, 1, 3, 4, 255, 256, 2**31, 2**63 - 1, 1.0, 0.5, "", "0", "x", "GPU-0", [], [0],
     [0, 0, False, "same-board"], {}, {"a": 1}, "same-board", "nonsense-level"]
)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document: dict keys and list positions, nested."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            found.extend(paths(child, (*prefix, key)))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found.extend(paths(child, (*prefix, index)))
    return found


INVENTORY_PATHS = paths(INVENTORY)
ASSIGNMENT_PATHS = paths(ASSIGNMENT)


def mutated(doc: Any, path: tuple[Any, ...], action: str, value: Any) -> Any:
    doc = copy.deepcopy(doc)
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if action == "delete":
        del parent[last]
    elif action == "add" and isinstance(parent, list):
        parent.insert(last, value)
    elif action == "add" and isinstance(parent, dict):
        parent[f"{last}-extra"] = value
    else:
        parent[last] = value
    return doc


def decode_inventory_safely(text: Any) -> None:
    """decode_inventory must either succeed with something a node can be built from, or raise ProtocolError."""
    try:
        inventory = protocol.decode_inventory(text)
    except protocol.ProtocolError:
        return
    node = NodeState("n1", inventory)
    assert len(node.gpus) == len(inventory.gpus)
    assert len({gpu.uuid for gpu in inventory.gpus}) == len(inventory.gpus)
    assert len({gpu.index for gpu in inventory.gpus}) == len(inventory.gpus)
    indexes = {gpu.index for gpu in inventory.gpus}
    assert all(0 <= index < protocol.MAX_GPUS_PER_NODE for index in indexes)
    assert all(link.peer_index in indexes - {gpu.index} for gpu in inventory.gpus for link in gpu.links)


def decode_assignment_safely(text: Any) -> None:
    try:
        assignment = protocol.decode_assignment(text)
    except protocol.ProtocolError:
        return
    usage_from_assignment(NodeState("n1", A100_NODE), assignment)
    assert all(d.memory_mib >= 0 and d.cores >= 0 for d in assignment.all_devices())


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(path=st.sampled_from(INVENTORY_PATHS), action=st.sampled_from(["replace", "delete", "add"]),
       value=JSON_VALUES | EDGE_VALUES)
def test_any_json_in_any_inventory_field_raises_only_protocol_error(path: tuple[Any, ...], action: str,
                                                                    value: Any) -> None:
    decode_inventory_safely(orjson.dumps(mutated(INVENTORY, path, action, value)).decode())


@FUZZ
@given(path=st.sampled_from(ASSIGNMENT_PATHS), action=st.sampled_from(["replace", "delete", "add"]),
       value=JSON_VALUES | EDGE_VALUES)
def test_any_json_in_any_assignment_field_raises_only_protocol_error(path: tuple[Any, ...], action: str,
                                                                     value: Any) -> None:
    decode_assignment_safely(orjson.dumps(mutated(ASSIGNMENT, path, action, value)).decode())


@FUZZ
@given(document=JSON_VALUES | st.text(max_size=40) | st.binary(max_size=40) | EDGE_VALUES)
def test_any_document_or_non_string_raises_only_protocol_error(document: Any) -> None:
    for text in (document, orjson.dumps(document).decode() if not isinstance(document, bytes) else document):
        decode_inventory_safely(text)
        decode_assignment_safely(text)


def inventory_with(change: Any) -> str:
    doc = copy.deepcopy(INVENTORY)
    change(doc)
    return orjson.dumps(doc).decode()


def set_link(gpu: int, link: int, position: int, value: Any) -> Any:
    def change(doc: Any) -> None:
        doc["gpus"][gpu]["links"][link][position] = value
    return change


def set_gpu(gpu: int, key: str, value: Any) -> Any:
    def change(doc: Any) -> None:
        doc["gpus"][gpu][key] = value
    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # the reported probes: a non-integer peer, null and list values were ValueError / TypeError
        (set_link(0, 0, 0, "x"), "field 'peer' must be an integer, not str"),
        (set_link(0, 0, 0, None), "field 'peer' must be an integer, not NoneType"),
        (set_link(0, 0, 1, [1]), "field 'nvlinks' must be an integer, not list"),
        (set_link(0, 0, 0, 1.0), "field 'peer' must be an integer, not float"),
        (set_link(0, 0, 2, "yes"), "field 'nvswitch' must be true or false"),
        (set_link(0, 0, 3, ["same-board"]), "unknown PCIe level"),
        (set_link(0, 0, 1, -1), "field 'nvlinks' must be between 0 and"),
        # accepted before: duplicate UUIDs, negative or huge indexes, links to GPUs that are not there
        (set_gpu(1, "uuid", INVENTORY["gpus"][0]["uuid"]), "duplicate GPU UUID"),
        (set_gpu(1, "uuid", ""), "field 'uuid' must not be empty"),
        (set_gpu(1, "index", -1), "field 'index' must be between 0 and 255, got -1"),
        (set_gpu(1, "index", 2**40), "field 'index' must be between 0 and 255"),
        (set_link(0, 0, 0, 7), "link to GPU 7, which is not on this node"),
        (set_link(0, 0, 0, 0), "lists a link to itself"),
        (set_link(0, 1, 0, INVENTORY["gpus"][0]["links"][0][0]), "is described twice"),
        (set_gpu(0, "numa", -1), "field 'numa' must be between 0 and"),
        (set_gpu(0, "numa", True), "field 'numa' must be an integer, not bool"),
    ],
)
def test_malformed_inventories_name_the_field(change: Any, message: str) -> None:
    with pytest.raises(protocol.ProtocolError, match=re.escape(message)):
        protocol.decode_inventory(inventory_with(change))


def test_too_many_gpus_refused() -> None:
    doc = copy.deepcopy(INVENTORY)
    doc["gpus"] = [dict(doc["gpus"][0], index=i, uuid=f"GPU-{i}", links=[])
                   for i in range(protocol.MAX_GPUS_PER_NODE + 1)]
    with pytest.raises(protocol.ProtocolError, match="at most 256"):
        protocol.decode_inventory(orjson.dumps(doc).decode())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda doc: doc["containers"][0]["devices"][0].__setitem__(1, True), "must be an integer, not bool"),
        (lambda doc: doc["containers"][0]["devices"][0].__setitem__(2, -5), "must be at least 0, got -5"),
        (lambda doc: doc["containers"][0]["devices"][0].__setitem__(0, ""), "non-empty string"),
        (lambda doc: doc["containers"][0].__setitem__("init", "yes"), "field 'init' must be true or false"),
        (lambda doc: doc.__setitem__("node", None), "field 'node' has the wrong type"),
    ],
)
def test_malformed_assignments_name_the_field(change: Any, message: str) -> None:
    doc = copy.deepcopy(ASSIGNMENT)
    change(doc)
    with pytest.raises(protocol.ProtocolError, match=re.escape(message)):
        protocol.decode_assignment(orjson.dumps(doc).decode())


def test_what_the_producers_write_still_decodes() -> None:
    for topology in TOPOLOGIES:
        inventory = synth_inventory("n1", 8, "NVIDIA-A100-SXM4-80GB", 81920, topology)
        assert protocol.decode_inventory(protocol.encode_inventory(inventory)) == inventory
    assert protocol.encode_assignment(protocol.decode_assignment(orjson.dumps(ASSIGNMENT).decode())) == \
        orjson.dumps(ASSIGNMENT).decode()
