import json

import pytest

from dlm_toolkit import ConfigError, DecodingPolicy, PolicyConfig, load_policy
from dlm_toolkit.config import flatten, unflatten
from dlm_toolkit.strategy.policy_config import apply_overrides
from dlm_toolkit.strategy.presets import list_presets


def test_presets_exist_and_validate():
    assert {"llada2.1-q", "llada2.1-s", "llada2.0", "llada-lowconf"} <= set(list_presets())
    q, s = load_policy("llada2.1-q"), load_policy("llada2.1-s")
    assert (q.m2t.params["threshold"], q.t2t.params["threshold"]) == (0.7, 0.5)
    assert (s.m2t.params["threshold"], s.t2t.params["threshold"]) == (0.5, 0.0)
    assert q.blocks.params == s.blocks.params == {"block_length": 32, "max_post_steps": 16, "eos_early_stop": True, "align": "absolute"}
    assert load_policy("llada2.0").t2t.name == "none"


def test_canonical_json_round_trip_and_hash():
    p = load_policy("llada2.1-s")
    again = PolicyConfig.model_validate(json.loads(p.canonical_json()))
    assert again == p and again.config_hash() == p.config_hash()
    assert load_policy("llada2.1-q").config_hash() != p.config_hash()
    assert len(p.config_hash()) == 12


def test_flat_keys_both_ways():
    p = load_policy("llada2.1-q")
    flat = p.flat()
    assert flat["m2t.params.threshold"] == 0.7 and flat["blocks.params.block_length"] == 32
    assert PolicyConfig.model_validate(unflatten(flat)) == p
    assert flatten({"a": {"b": 1, "c": {"d": 2}}}) == {"a.b": 1, "a.c.d": 2}


def test_name_override_resets_params_before_params_apply():
    s = load_policy("llada2.1-s", {"t2t.name": "none"})
    assert s.t2t.name == "none" and s.t2t.params == {}
    # switching rule and setting a param of the new rule in the same call
    p = load_policy("llada2.1-s", {"m2t.params.steps_per_block": 8, "m2t.name": "topk"})
    assert p.m2t.name == "topk" and p.m2t.params["steps_per_block"] == 8
    assert p.m2t.params["ranking"] == "low_confidence"  # topk's default, nothing inherited


@pytest.mark.parametrize(
    "override, fragments",
    [
        ({"m2t.params.threshold": 1.5}, ["m2t.params.threshold", "1.5", "0.0 < x <= 1.0"]),
        ({"m2t.params.threshold": 0}, ["m2t.params.threshold", "0.0 < x <= 1.0"]),
        ({"t2t.params.threshold": -0.1}, ["t2t.params.threshold", "-0.1", "0.0 <= x <= 1.0"]),
        ({"blocks.params.block_length": 0}, ["blocks.params.block_length", "1 <= x"]),
        ({"blocks.params.max_post_steps": -1}, ["blocks.params.max_post_steps", "-1"]),
        ({"sampling.top_p": 0}, ["sampling.top_p", "0.0 < x <= 1.0"]),
        ({"m2t.params.bogus": 1}, ["m2t.params.bogus", "Extra inputs"]),
        ({"m2t.name": "nope"}, ["nope", "available", "threshold", "topk"]),
        ({"bogus.x": 1}, ["bogus.x", "unknown key"]),
        ({"m2t.threshold": 0.5}, ["m2t.threshold", "m2t.params.FIELD"]),
    ],
)
def test_invalid_values_name_field_value_and_range(override, fragments):
    with pytest.raises(ConfigError) as err:
        load_policy("llada2.1-q", override)
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="llada2.1-q"):
        load_policy("no-such-preset")


def test_policy_file_json_and_yaml(tmp_path):
    (tmp_path / "p.yaml").write_text("m2t: {name: threshold, params: {threshold: 0.8}}\nblocks: {name: semi_ar, params: {block_length: 8}}\n")
    p = load_policy(str(tmp_path / "p.yaml"))
    assert p.m2t.params["threshold"] == 0.8 and p.t2t.name == "none" and p.blocks.params["block_length"] == 8
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        load_policy(str(tmp_path / "bad.json"))


def test_configs_are_frozen():
    p = load_policy("llada2.1-q")
    with pytest.raises(Exception):
        p.m2t = p.t2t  # type: ignore[misc]
    pol = DecodingPolicy("llada2.1-q")
    with pytest.raises(Exception):
        pol.m2t.config.threshold = 0.1  # type: ignore[misc]


def test_apply_overrides_does_not_touch_input():
    base = load_policy("llada2.1-q").model_dump(mode="json")
    before = json.dumps(base, sort_keys=True)
    apply_overrides(base, {"m2t.params.threshold": 0.3, "t2t.name": "none"})
    assert json.dumps(base, sort_keys=True) == before
