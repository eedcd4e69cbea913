"""Shipped probe configs load and validate; bad configs explain themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guardrail.errors import ConfigError, HeadsDoNotFitModelError, ModelConfigNotFoundError
from guardrail.probe.config import (
    ModelProbeConfig,
    _packaged_configs,
    load_model_config,
    packaged_model_configs,
    read_model_config,
)


@pytest.mark.parametrize("path", _packaged_configs(), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_fits_its_model(path):
    cfg = read_model_config(path)
    assert cfg.heads and cfg.num_layers and cfg.num_heads
    cfg.check_fits(cfg.num_layers, cfg.num_heads)
    assert path.name == cfg.model_id.split("/")[-1] + ".json"


def test_the_six_published_models_are_shipped():
    shipped = set(packaged_model_configs())
    data = Path(__file__).resolve().parents[3] / "shared" / "data" / "attention_tracker_heads.json"
    if not data.exists():
        pytest.skip("shared data not beside the checkout")
    models = json.loads(data.read_text())["models"]
    for model_id, entry in models.items():
        assert model_id in shipped
        assert [list(h) for h in packaged_model_configs()[model_id].heads] == entry[
            "important_heads"
        ]


def test_lookup_by_id_and_by_local_directory_name():
    assert load_model_config("Qwen/Qwen2-1.5B-Instruct").model_id == "Qwen/Qwen2-1.5B-Instruct"
    assert load_model_config("/models/Qwen2-1.5B-Instruct").model_id == "Qwen/Qwen2-1.5B-Instruct"
    with pytest.raises(ModelConfigNotFoundError, match="guardrail calibrate"):
        load_model_config("/models/some-other-model")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"heads": []}, "at least 1"),
        ({"heads": [[0, 1], [0, 1]]}, "duplicates"),
        ({"heads": [[-1, 0]]}, "0-based"),
        ({"threshold": 1.5}, "less than or equal to 1"),
        ({"probe": "logistic"}, "needs 1 weight per head"),
        (
            {"probe": "logistic", "feature": "attention_stats", "weights": [1.0]},
            "'attention_stats' needs 5 weights per head: 1 heads, 1 weights",
        ),
        ({"weights": [1.0]}, "only used by probe 'logistic'"),
        ({"feature": "logit_focus"}, "only used by probe 'logistic'"),
        ({"colour": "red"}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_configs_name_the_problem(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelProbeConfig.model_validate({"model_id": "m", "heads": [[0, 0]], **fields})


def test_heads_outside_the_model_say_expected_and_how_to_fix():
    cfg = ModelProbeConfig(model_id="m", heads=[(3, 1), (40, 2)])
    with pytest.raises(HeadsDoNotFitModelError) as info:
        cfg.check_fits(num_layers=30, num_heads=9)
    text = str(info.value)
    assert "(40, 2)" in text and "30 layers x 9 heads" in text and "guardrail calibrate" in text
    assert isinstance(info.value, ValueError)


def test_a_broken_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_id": "m"}')
    with pytest.raises(ConfigError, match=r"(?s)bad.json.*heads"):
        read_model_config(bad)
