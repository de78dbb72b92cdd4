"""The grid config file: Dynamo's JSON (and YAML) read as Dynamo reads it, every operator mistake a
``ConfigError`` that names the file and the key."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dynamod.daemon.global_router.config import (
    MODE_AGG,
    MODE_DISAGG,
    STAGE_AGG,
    STAGE_DECODE,
    STAGE_PREFILL,
    config_from_dict,
    load_config,
)
from dynamod.shared.errors import ConfigError
from tests.unit.global_router.grids import agg_grid, disagg_grid


def test_json_file_loads_with_dynamos_defaults(tmp_path: Path) -> None:
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(disagg_grid()))
    config = load_config(path)
    assert config.mode == MODE_DISAGG and config.enable_priority_retry is False
    assert set(config.stages) == {STAGE_PREFILL, STAGE_DECODE}
    assert config.stages[STAGE_PREFILL].priorities == (0, 1)  # pool order: pool 0 fastest
    assert config.namespaces == ["p0", "p1", "d0", "d1"]


def test_yaml_file_reads_like_the_json_one(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    (tmp_path / "grid.json").write_text(json.dumps(agg_grid(enable_priority_retry=True)))
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(agg_grid(enable_priority_retry=True)))
    assert load_config(tmp_path / "grid.yaml") == load_config(tmp_path / "grid.json")
    assert load_config(tmp_path / "grid.yaml").mode == MODE_AGG


def test_deprecated_ttft_and_itl_spellings_still_load() -> None:
    grid = agg_grid()
    strategy = grid["agg_pool_selection_strategy"]
    strategy["ttft_min"] = strategy.pop("ttft_min_ms")
    strategy["itl_max"] = strategy.pop("itl_max_ms")
    stage = config_from_dict(grid).stages[STAGE_AGG]
    assert stage.strategy.ttft_min_ms == 0 and stage.strategy.itl_max_ms == 100  # type: ignore[union-attr]


def test_namespaces_are_listed_once_in_config_order() -> None:
    grid = disagg_grid(decode_pool_dynamo_namespaces=["p1", "d1"])
    assert config_from_dict(grid).namespaces == ["p0", "p1", "d1"]


def test_a_pool_in_the_global_routers_own_namespace_is_refused() -> None:
    config = config_from_dict(agg_grid())
    config.check_own_namespace("dynamo")
    with pytest.raises(ConfigError, match="'fast' is the global router's own namespace"):
        config.check_own_namespace("fast")


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    *parents, leaf = path.split(".")

    def edit(grid: dict[str, Any]) -> None:
        node = grid
        for p in parents:
            node = node[p]
        if value is _DELETE:
            del node[leaf]
        else:
            node[leaf] = value

    return edit


_DELETE = object()
S = "agg_pool_selection_strategy"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set("mode", "both"), "mode must be 'disagg' or 'agg', got 'both'"),
        (_set("num_agg_pools", 3), r"num_agg_pools \(3\) does not match agg_pool_dynamo_namespaces length \(2\)"),
        (_set("num_agg_pools", 0), "num_agg_pools must be at least 1"),
        (_set("num_agg_pools", _DELETE), "num_agg_pools is required in agg mode"),
        (_set(S, _DELETE), "agg_pool_selection_strategy is required in agg mode"),
        (_set("agg_pool_dynamo_namespaces", ["a", "a"]), "names a namespace twice"),
        (_set("agg_pool_dynamo_namespaces", ["a", "b/c"]), r"agg_pool_dynamo_namespaces\[1\] must be a name"),
        (_set("agg_pool_priorities", [0]), r"agg_pool_priorities length \(1\) does not match num_agg_pools \(2\)"),
        (_set("enable_priority_retry", "yes"), "Expected `bool`, got `str` - at `enable_priority_retry`"),
        (_set("num_prefill_pools", 2), "num_prefill_pools belong to the other mode"),
        (_set("tpyo", 1), "unknown field `tpyo`"),
        (_set(f"{S}.ttft_resoluton", 2), "unknown field `ttft_resoluton` - at `agg_pool_selection_strategy`"),
        (_set(f"{S}.ttft_resolution", "2"), "Expected `int`, got `str` - at `agg_pool_selection_strategy.ttft_resolution`"),
        (_set(f"{S}.ttft_resolution", 0), "ttft_resolution must be positive, got 0"),
        (_set(f"{S}.itl_min_ms", 100), r"itl minimum \(100\) must be less than its maximum \(100\)"),
        (_set(f"{S}.isl_max", _DELETE), "isl_min, isl_max and isl_resolution must be configured together"),
        (_set(f"{S}.agg_pool_mapping", [[[0], [1]]]), "agg_pool_mapping has 1 entries but isl_resolution is 2"),
        (_set(f"{S}.agg_pool_mapping", [[[0], [1]], [[0]]]), r"agg_pool_mapping\[1\] has 1 entries but ttft_resolution is 2"),
        (_set(f"{S}.agg_pool_mapping", [[[0], [1]], [[0], [0, 1]]]), r"agg_pool_mapping\[1\]\[1\] has 2 entries but itl_resolution is 1"),
        (_set(f"{S}.agg_pool_mapping", [[[0], [5]], [[0], [0]]]), r"agg_pool_mapping\[0\]\[1\]\[0\] is pool 5, but the pools are 0 to 1"),
        (_set(f"{S}.agg_pool_mapping", [[[0], [True]], [[0], [0]]]), r"\[0\]\[1\]\[0\] must be a pool index"),
        (_set(f"{S}.agg_pool_mapping", {"a": 1}), "Expected `array`, got `object` - at `agg_pool_selection_strategy.agg_pool_mapping`"),
        (_set(f"{S}.agg_pool_mapping", [[0, 1], [0, 0]]), r"agg_pool_mapping\[0\]\[0\] must be a list"),
        (_set(f"{S}.priority_overrides", [{"min_priority": 5, "max_priority": 1, "target_pool": 0}]),
         r"priority_overrides\[0\]: min_priority \(5\) must be <= max_priority \(1\)"),
        (_set(f"{S}.priority_overrides", [{"min_priority": 0, "max_priority": 1, "target_pool": 2}]),
         r"priority_overrides\[0\]: target_pool 2 is not a pool \(0 to 1\)"),
        (_set(f"{S}.priority_overrides", [{"min_priority": 0, "max_priority": 1}]), "missing required field `target_pool`"),
    ],
)
def test_agg_config_mistakes_are_config_errors(edit: Callable[[dict[str, Any]], None], message: str) -> None:
    grid = copy.deepcopy(agg_grid())
    edit(grid)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(grid)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set("num_decode_pools", _DELETE), "num_decode_pools is required in disagg mode"),
        (_set("agg_pool_selection_strategy", {}), "agg_pool_selection_strategy belong to the other mode"),
        (_set("prefill_pool_selection_strategy.isl_min", 4000), r"isl minimum \(4000\) must be less than its maximum \(4000\)"),
        (_set("prefill_pool_selection_strategy.prefill_pool_mapping", [[0, 1]] * 3), "has 3 entries but isl_resolution is 4"),
        (_set("decode_pool_selection_strategy.decode_pool_mapping", [[0, 0, 1], [0, 0, 0, 1]]),
         r"decode_pool_mapping\[0\] has 3 entries but itl_resolution is 4"),
        (_set("decode_pool_selection_strategy.context_length_resolution", -1), "context_length_resolution must be positive"),
        (_set("decode_pool_selection_strategy.itl_min", 5), "has both 'itl_min' and 'itl_min_ms'"),
    ],
)
def test_disagg_config_mistakes_are_config_errors(edit: Callable[[dict[str, Any]], None], message: str) -> None:
    grid = copy.deepcopy(disagg_grid())
    edit(grid)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(grid)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read global router config .*missing.json"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json is not valid JSON"):
        load_config(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(agg_grid(num_agg_pools=5)))
    with pytest.raises(ConfigError, match=r"wrong.json: num_agg_pools \(5\)"):
        load_config(wrong)
    listed = tmp_path / "list.json"
    listed.write_text("[]")
    with pytest.raises(ConfigError, match="the top level must be an object"):
        load_config(listed)
