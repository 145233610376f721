"""The bus's schema check (`check_schema`): every put held to its field's FieldSpec."""

from __future__ import annotations

import pytest
import torch

from rlx.bus import LocalBus
from rlx.bus.schema import SchemaError
from rlx.config import build_config
from rlx.orchestration.plan import FIELDS, bus_schema


def _row(**extra) -> dict[str, list]:
    return {"group_id": [0], "prompt_ids": [[1, 2]], "response_ids": [[3, 4, 5]],
            "rollout_logprobs": [[-0.1, -0.2, -0.3]], **{k: [v] for k, v in extra.items()}}


def test_a_bus_without_the_check_takes_anything():
    bus = LocalBus()
    (row,) = bus.put({"group_id": ["zero"], "no_such_field": [object()]}, group_ids=[0])
    assert bus.index.rows[row].values["group_id"] == "zero"


def test_puts_that_match_their_fields_pass_and_none_stands_for_absent():
    bus = LocalBus(check_schema=FIELDS)
    (row,) = bus.put(_row(finish_reason="stop", metadata={"k": 1}, loss_mask=None), group_ids=[0])
    bus.put_fields([row], {"reward": [1], "ref_logprobs": [[-1.0, -2.0, -3.0]], "filter_reason": [None]})
    bus.put_fields([row], {"routed_experts": [torch.zeros(4, 2, 1, dtype=torch.int16)]})
    bus.put_group(0, {"media_inputs": {"pixel_values": torch.zeros(1, 3)}}, rows=1)
    assert bus.index.rows[row].values["reward"] == 1


@pytest.mark.parametrize("put,message", [
    (lambda bus, row: bus.put_fields([row], {"ref_logprobs": [[-1.0, -2.0]]}),
     r"bus field 'ref_logprobs' \(written by 'reference'\), row 0: expected float32\[T=3\], got a list of 2 \(float\)"),
    (lambda bus, row: bus.put_fields([row], {"reward": ["1.0"]}),
     r"bus field 'reward' \(written by 'reward'\), row 0: expected float32 scalar, got str '1.0'"),
    (lambda bus, row: bus.put_fields([row], {"advantage": [torch.tensor(0.5)]}),
     r"'advantage' \(written by 'advantages'\), row 0: expected float32 scalar, got a float32 tensor of shape \[\]"),
    (lambda bus, row: bus.put_fields([row], {"routed_experts": [torch.zeros(4, 2, 1)]}),
     r"'routed_experts' \(written by 'rollout'\), row 0: expected int16\[S\]\[L\]\[K\], got a float32 tensor"),
    (lambda bus, row: bus.put_fields([row], {"media_inputs": [{}]}),
     r"'media_inputs' \(written by 'rollout'\) has scope 'group' and came in a row-scoped put: write it with put_group"),
    (lambda bus, row: bus.put_group(0, {"reward": 1.0}, rows=1),
     r"'reward' \(written by 'reward'\) has scope 'row' and came in a group-scoped put"),
    (lambda bus, row: bus.put_fields([row], {"rewrd": [1.0]}),
     r"bus field 'rewrd' is not declared: add its FieldSpec to FIELDS"),
    (lambda bus, row: bus.put(_row(response_ids=None) | {"response_ids": [[3, 4]]}, group_ids=[0]),
     r"'rollout_logprobs' \(written by 'rollout'\), row 1: expected float32\[T=2\], got a list of 3"),
])
def test_a_put_that_breaks_its_field_names_the_field_the_writer_what_was_expected_and_what_came(put, message):
    bus = LocalBus(check_schema=FIELDS)
    (row,) = bus.put(_row(), group_ids=[0])
    with pytest.raises(SchemaError, match=message):
        put(bus, row)


def test_a_row_that_left_the_bus_is_forgotten():
    bus = LocalBus(check_schema=FIELDS)
    rows = bus.put(_row(), group_ids=[0])
    bus.clear(rows)
    assert bus.index.schema.sizes == {}


def test_runs_check_their_bus_only_when_the_debug_setting_says_so():
    assert bus_schema(build_config({})) is None
    assert bus_schema(build_config({"train": {"check_bus_schema": True}})) is FIELDS
