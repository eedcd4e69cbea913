"""Shipped probe configs load and validate; bad configs explain themselves."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest

from guardrail.errors import ConfigError, HeadsDoNotFitModelError, ModelConfigNotFoundError
from guardrail.probe.config import (
    MAX_CONFIG_BYTES,
    MAX_JSON_DEPTH,
    ModelProbeConfig,
    _packaged_configs_all,
    load_model_config,
    model_id_matches,
    packaged_model_configs,
    read_model_config,
    resolve_config,
    shipped_variants,
)


@pytest.mark.parametrize("path", _packaged_configs_all(), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_fits_its_model(path):
    cfg = read_model_config(path)
    assert cfg.heads and cfg.num_layers and cfg.num_heads
    cfg.check_fits(cfg.num_layers, cfg.num_heads)
    facts = {"num_layers": cfg.num_layers, "num_heads": cfg.num_heads}
    assert cfg.check_model(cfg.model_id, facts) == []
    stem = cfg.model_id.split("/")[-1]  # <model>.json, or <model>.<variant>.json
    names = [f"{stem}.json"] + [f"{stem}.{v}.json" for v in shipped_variants(cfg.model_id)]
    assert path.name in names


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


def test_a_shipped_variant_is_chosen_by_name_or_as_the_eager_default(tmp_path, monkeypatch):
    smol = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert shipped_variants(smol) == ["combined"]
    assert shipped_variants("/models/SmolLM2-135M-Instruct-f32") == ["combined"]
    assert shipped_variants("Qwen/Qwen2-1.5B-Instruct") == []
    default, combined = resolve_config(smol, None), resolve_config(smol, "combined")
    assert default.hidden is None and default == load_model_config(smol)
    reads = [(p.layer, p.position) for p in combined.hidden or []]
    assert combined.model_id == smol
    assert reads == [
        (15, "last"),
        (18, "last"),
        (15, "data_mean"),
        (15, "data_top"),  # the token read-out: one model over layers 15, 18 and 21
        (18, "data_top"),
        (21, "data_top"),
    ]
    assert [p.top_k for p in combined.hidden or []] == [None, None, None, 10, 10, 10]
    assert combined.probe == "logistic" and combined.threshold is not None
    assert packaged_model_configs()[smol] == default  # the variant never replaces the file
    # an engine that reads the hidden state (eager, or compiled on the CPU) of a model that
    # ships the variant reads it; other models their default
    assert resolve_config(smol, None, reads_hidden=True) == combined
    assert resolve_config("/models/SmolLM2-135M-Instruct-f32", None, reads_hidden=True) == combined
    qwen = "Qwen/Qwen2-1.5B-Instruct"
    assert resolve_config(qwen, None, reads_hidden=True) == resolve_config(qwen, None)
    assert resolve_config(smol, "combined", reads_hidden=False) == combined  # named: always
    with pytest.raises(ModelConfigNotFoundError, match=r"variant 'combined'.*its variants: none"):
        resolve_config("Qwen/Qwen2-1.5B-Instruct", "combined")
    with pytest.raises(ModelConfigNotFoundError, match=r"its variants: \['combined'\]"):
        resolve_config(smol, "attention_only")
    # a file of that name in the working directory is a path, not a variant
    monkeypatch.chdir(tmp_path)
    (tmp_path / "combined").write_text(default.model_dump_json())
    assert resolve_config(smol, "combined") == default


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
        ({"colour": "red"}, "unknown field 'colour': remove it .*valid fields: schema_version"),
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


# -- strict, finite numbers (issue "Reliability and security", item 5) -------------------------

BASE = {"model_id": "m", "heads": [[0, 0]]}
LOGISTIC = {**BASE, "probe": "logistic", "feature": "logit_focus", "weights": [1.0]}


@pytest.mark.parametrize(
    ("fields", "field", "what"),
    [
        ({**BASE, "threshold": True}, "threshold = True", "must be a number, not bool"),
        ({**BASE, "threshold": "0.5"}, "threshold = '0.5'", "must be a number, not str"),
        ({**BASE, "threshold": math.nan}, "threshold = nan", "must be a finite number"),
        ({**LOGISTIC, "weights": [math.nan]}, "weights.0 = nan", "must be a finite number"),
        ({**LOGISTIC, "bias": math.inf}, "bias = inf", "must be a finite number"),
        ({**LOGISTIC, "bias": -math.inf}, "bias = -inf", "must be a finite number"),
        ({**LOGISTIC, "bias": 10**400}, "bias = <an integer of 1329 bits>", "too large"),
        ({**LOGISTIC, "weights": [False]}, "weights.0 = False", "not bool"),
        ({**BASE, "num_layers": 30.0}, "num_layers = 30.0", "must be a whole number, not float"),
        ({**BASE, "num_heads": "9"}, "num_heads = '9'", "must be a whole number, not str"),
        ({**BASE, "heads": [[True, 0]]}, "heads.0.0 = True", "must be a whole number, not bool"),
        ({**BASE, "heads": [[2**70, 0]]}, "heads.0.0 = 1180591620717411303424", "too large"),
        ({**BASE, "schema_version": True}, "schema_version = True", "not bool"),
        (
            {
                **BASE,
                "calibration": {
                    "dataset": "d",
                    "num_examples": 9,
                    "sha256": "",
                    "thresholds": {"x": math.inf},
                },
            },
            "calibration.thresholds.x = inf",
            "finite",
        ),
        (
            {**BASE, "calibration": {"dataset": "d", "num_examples": 1.5, "sha256": ""}},
            "calibration.num_examples = 1.5",
            "whole number",
        ),
    ],
)
def test_numbers_are_strict_and_finite_from_python_and_files(tmp_path, fields, field, what):
    with pytest.raises(ConfigError) as built:
        ModelProbeConfig(**fields)
    assert isinstance(built.value, ValueError)
    text = str(built.value)
    assert text.startswith("invalid ModelProbeConfig: ") and field in text and what in text
    with pytest.raises(ConfigError, match="invalid ModelProbeConfig") as validated:
        ModelProbeConfig.model_validate(fields)
    assert field in str(validated.value)
    if not any(isinstance(v, float) and not math.isfinite(v) for v in _leaves(fields)):
        path = tmp_path / "cfg.json"
        path.write_text(json.dumps(fields, default=str))
        with pytest.raises(ConfigError) as read:
            read_model_config(path)
        assert f"invalid model config {path}: " in str(read.value) and what in str(read.value)


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_json_numbers_in_a_file_name_the_field(tmp_path, token):
    path = tmp_path / "cfg.json"
    path.write_text('{"model_id": "m", "heads": [[0, 0]], "threshold": ' + token + "}")
    with pytest.raises(ConfigError, match=r"threshold = .*must be a finite number"):
        read_model_config(path)


def test_error_says_how_to_fix_it():
    with pytest.raises(ConfigError) as info:
        ModelProbeConfig(**{**BASE, "threshold": True})
    assert "write a plain number such as 0.5 (no quotes, not true/false)" in str(info.value)


def test_numpy_and_python_numbers_are_still_accepted():
    cfg = ModelProbeConfig(
        model_id="m",
        heads=[(np.int64(2), 1)],
        probe="logistic",
        feature="logit_focus",
        weights=[np.float32(0.5)],
        bias=1,
        threshold=np.float64(0.25),
        num_layers=np.int32(4),
    )
    assert cfg.heads == [(2, 1)] and cfg.bias == 1.0 and cfg.threshold == 0.25
    assert type(cfg.num_layers) is int and type(cfg.weights[0]) is float
    assert ModelProbeConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def test_nested_objects_with_odd_keys_are_config_errors():
    """Nested models are validated by pydantic itself (not through ``__init__(**data)``, which
    would raise TypeError on a non-string key)."""
    data = {**BASE, "calibration": {1: 2, "dataset": "d", "num_examples": 1, "sha256": ""}}
    with pytest.raises(ConfigError, match=r"calibration.1 = 1: Keys should be strings"):
        ModelProbeConfig.model_validate(data)
    with pytest.raises(ConfigError, match=r"1 = 1: Keys should be strings"):
        ModelProbeConfig.model_validate({1: 2, **BASE})


def test_sizes_must_agree_with_the_heads():
    with pytest.raises(ConfigError, match=r"heads \[\(30, 0\)\] lie outside .*30 layers x 9 heads"):
        ModelProbeConfig(model_id="m", heads=[(30, 0)], num_layers=30, num_heads=9)
    with pytest.raises(ConfigError, match="num_kv_heads 4 must divide num_heads 9"):
        ModelProbeConfig(model_id="m", heads=[(0, 0)], num_heads=9, num_kv_heads=4)
    with pytest.raises(ConfigError, match=r"hidden_size = 0: .*greater than or equal to 1"):
        ModelProbeConfig(model_id="m", heads=[(0, 0)], hidden_size=0)


# -- the config's model (item 6) ---------------------------------------------------------------

SMOL_FACTS = {"num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "hidden_size": 576}
LLAMA3_8B_FACTS = {"num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "hidden_size": 4096}
SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_shipped_smollm2_config_identifies_its_model():
    cfg = load_model_config(SMOL)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size) == (30, 9, 3, 576)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cfg.check_model(SMOL, SMOL_FACTS) == []
        assert cfg.check_model("/cache/models/SmolLM2-135M-Instruct-f32", SMOL_FACTS) == []


def test_smollm2_heads_fit_llama3_8b_but_the_config_is_refused():
    cfg = load_model_config(SMOL)
    cfg.check_fits(32, 32)  # the old check alone lets it through
    with pytest.raises(ConfigError) as info:
        cfg.check_model("meta-llama/Meta-Llama-3-8B-Instruct", LLAMA3_8B_FACTS)
    text = str(info.value)
    assert f"probe config for {SMOL!r} was made for another model" in text
    assert "'meta-llama/Meta-Llama-3-8B-Instruct'" in text
    for fact in ("num_layers: config 30, served model 32", "num_heads: config 9, served model 32"):
        assert fact in text
    assert "num_kv_heads: config 3, served model 8" in text
    assert "hidden_size: config 576, served model 4096" in text
    assert "probe_config=" in text and "guardrail calibrate" in text


def test_one_differing_size_is_enough():
    cfg = load_model_config(SMOL)
    with pytest.raises(ConfigError, match="hidden_size: config 576, served model 640"):
        cfg.check_model(SMOL, {**SMOL_FACTS, "hidden_size": 640})


def test_a_head_outside_the_served_model_is_still_heads_do_not_fit():
    cfg = ModelProbeConfig(model_id="m", heads=[(5, 0)])
    with pytest.raises(HeadsDoNotFitModelError, match="2 layers x 4 heads"):
        cfg.check_model("m", {"num_layers": 2, "num_heads": 4})


def test_model_id_mismatch_with_matching_sizes_is_a_warning():
    cfg = load_model_config(SMOL)
    with pytest.warns(UserWarning, match="does not match the served model 'my-org/support-bot'"):
        problems = cfg.check_model("my-org/support-bot", SMOL_FACTS)
    assert (
        len(problems) == 1
        and "num_layers, num_heads, num_kv_heads, hidden_size match" in problems[0]
    )
    assert f"labelled {SMOL!r}" in problems[0] and "guardrail calibrate" in problems[0]


def test_old_configs_without_sizes_only_warn_on_the_id():
    cfg = ModelProbeConfig(model_id="org/Tiny-1B", heads=[(0, 0)])
    with pytest.warns(UserWarning, match="records no model sizes to compare"):
        assert len(cfg.check_model("org/Other", LLAMA3_8B_FACTS)) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cfg.check_model("/models/tiny-1b-awq", {}) == []  # a missing fact is skipped


@pytest.mark.parametrize(
    ("model", "matches"),
    [
        (SMOL, True),
        (SMOL.lower(), True),
        ("/root/.cache/vllm-guardrail/models/SmolLM2-135M-Instruct-f32", True),
        ("/models/smollm2-135m-instruct/", True),
        ("/models/SmolLM2-360M-Instruct", False),
        ("meta-llama/Meta-Llama-3-8B-Instruct", False),
        ("", False),
    ],
)
def test_model_id_matching_is_the_lookup_rule(model, matches):
    assert model_id_matches(SMOL, model) is matches


# -- reading files safely (item 5, files) ------------------------------------------------------


def test_invalid_utf8_names_the_file_and_the_byte(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"model_id": "caf\xe9", "heads": [[0, 0]]}')
    with pytest.raises(ConfigError) as info:
        read_model_config(path)
    assert str(path) in str(info.value) and "not UTF-8 at byte 17" in str(info.value)
    assert isinstance(info.value.__cause__, UnicodeDecodeError)


def test_a_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(BASE).encode())
    assert read_model_config(path).model_id == "m"


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5000, 200_000])
def test_deep_nesting_is_refused_before_parsing(tmp_path, depth):
    path = tmp_path / "deep.json"
    path.write_text('{"model_id": "m", "heads": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ConfigError) as info:
        read_model_config(path)
    assert str(path) in str(info.value)
    assert f"nested {depth + 1} levels deep, deeper than the {MAX_JSON_DEPTH} allowed" in str(
        info.value
    )


def test_brackets_inside_strings_do_not_count_as_nesting(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text(json.dumps({**BASE, "source": "[" * 500 + '\\"{' * 100}))
    assert read_model_config(path).source.startswith("[[[")


def test_oversized_files_are_refused_unread(tmp_path):
    path = tmp_path / "huge.json"
    with path.open("wb") as handle:
        handle.truncate(MAX_CONFIG_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ConfigError, match=r"huge.json is over 10 MB, the most a config may be"):
        read_model_config(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"model_id": "m", "heads": [[0, 0]]',
            r"not valid JSON: Expecting ',' delimiter at line 1",
        ),
        ('{"model_id": "m", "heads": [[' + "1" * 5000 + ", 0]]}", "JSON that cannot be read"),
        ("[1, 2]", r"value = \[1, 2\]: Input should be a valid dictionary"),
        ("", "not valid JSON: Expecting value at line 1 column 1"),
    ],
)
def test_broken_json_is_a_config_error_naming_the_file(tmp_path, content, message):
    path = tmp_path / "broken.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as info:
        read_model_config(path)
    assert str(path) in str(info.value)


def test_a_directory_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match="model config file not found"):
        read_model_config(tmp_path)


def _hidden(**overrides):
    part = {"layer": 1, "dims": [0, 5], "mean": [0.0, 1.0], "scale": [1.0, 2.0]}
    return [{**part, "weights": [1.0, -1.0], **overrides}]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden": _hidden()}, "hidden is only used by probe 'logistic'"),
        ({"probe": "logistic", "weights": [0.0], "hidden": _hidden(weights=[1.0])}, "2 dims, 2 "),
        ({"probe": "logistic", "weights": [0.0], "hidden": _hidden(scale=[1.0, 0.0])}, "> 0"),
        ({"probe": "logistic", "weights": [0.0], "hidden": _hidden(dims=[3, 3])}, "distinct"),
        (
            {"probe": "logistic", "weights": [0.0], "hidden": _hidden() + _hidden()},
            "lists a \\(layer, position\\) twice",
        ),
        (
            {"probe": "logistic", "weights": [0.0], "hidden": _hidden(position="first")},
            "Input should be 'last', 'data_mean' or 'data_top'",
        ),
        (
            {"probe": "logistic", "weights": [0.0], "hidden": _hidden(position="data_top")},
            "top_k .* goes with position 'data_top', and only with it",
        ),
        (
            {"probe": "logistic", "weights": [0.0], "hidden": _hidden(top_k=3)},
            "top_k .* goes with position 'data_top', and only with it",
        ),
        (
            {
                "probe": "logistic",
                "weights": [0.0],
                "hidden": _hidden(position="data_top", top_k=0),
            },
            "greater than or equal to 1",
        ),
        (
            {
                "probe": "logistic",
                "weights": [0.0],
                "hidden": _hidden(position="data_top", top_k=2)
                + _hidden(layer=3, position="data_top", top_k=5),
            },
            "one token model over their layers and share top_k; got top_k \\[2, 5\\]",
        ),
        (
            {"probe": "logistic", "weights": [0.0], "hidden": _hidden(), "hidden_size": 4},
            "reads coordinate 5, outside the config's hidden_size 4",
        ),
        (
            {"probe": "logistic", "weights": [0.0], "hidden": _hidden(layer=7), "num_layers": 4},
            "hidden layer 7 lies outside the config's 4 layers",
        ),
    ],
)
def test_invalid_hidden_parts_name_the_problem(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelProbeConfig.model_validate({"model_id": "m", "heads": [[0, 0]], **fields})


def test_hidden_terms_add_to_the_logit():
    """focus = 1 - sigmoid(bias + head part + hidden terms); the terms are each layer's
    standardised read-out, computed independently here."""
    cfg = ModelProbeConfig.model_validate(
        {
            "model_id": "m",
            "heads": [[0, 0]],
            "probe": "logistic",
            "weights": [-2.0],
            "bias": 0.5,
            "hidden": _hidden(),
        }
    )
    stream = np.zeros(8)
    stream[0], stream[5] = 3.0, 5.0
    term = cfg.hidden[0].project(stream)
    assert term == pytest.approx(3.0 * 1.0 - (5.0 - 1.0) / 2.0)
    focus = cfg.focus({(0, 0): [0.8, 0.2, 0, 0, 0]}, {1: term})
    z = 0.5 - 2.0 * 0.8 + term
    assert focus == pytest.approx(1 - 1 / (1 + math.exp(-z)))
    with pytest.raises(ValueError, match="hidden state of layers \\[1\\]"):
        cfg.focus({(0, 0): [0.8, 0.2, 0, 0, 0]})
    with pytest.raises(HeadsDoNotFitModelError, match="hidden state of layers \\[1\\]"):
        cfg.check_fits(1, 4)


def test_a_layer_read_at_both_positions_adds_one_term_per_layer():
    """A layer with a last-token and a data-mean read-out: the worker reports the sum of the two
    terms for the layer, and the focus counts it once."""
    parts = _hidden() + _hidden(position="data_mean", weights=[0.5, 0.5])
    cfg = ModelProbeConfig.model_validate(
        {"model_id": "m", "heads": [[0, 0]], "probe": "logistic", "weights": [0.0], "hidden": parts}
    )
    assert cfg.hidden_layers == [1]
    assert cfg.hidden_layers_at("data_mean") == [1] and cfg.hidden_layers_at("last") == [1]
    last, mean = np.zeros(8), np.zeros(8)
    last[0], mean[5] = 2.0, 3.0
    term = cfg.hidden[0].project(last) + cfg.hidden[1].project(mean)
    z = term  # bias 0, head weight 0
    focus = cfg.focus({(0, 0): [0.8, 0.2, 0, 0, 0]}, {1: term})
    assert focus == pytest.approx(1 - 1 / (1 + math.exp(-z)))


def test_the_engine_arguments_decide_the_default_config(monkeypatch):
    """``engine_probe_config``: what the engine will run decides the default, through the same
    start arguments the engine gets (on the CPU, eager unless a compile argument is given): an
    engine that reads the hidden state (eager, or compiled on CPU or CUDA, whose decoder
    layers are tapped) the combined variant, a compiled engine on a device without a tapping
    worker the attention-only default."""
    from guardrail.engine import install
    from guardrail.engine.install import engine_probe_config

    smol = "HuggingFaceTB/SmolLM2-135M-Instruct"
    combined, default = load_model_config(smol, "combined"), load_model_config(smol)
    for device in ("cpu", "cuda", "xpu"):
        monkeypatch.setattr(install, "_device_type", lambda device=device: device)
        compiled = default if device == "xpu" else combined
        assert engine_probe_config(smol, None, {"enforce_eager": True}) == combined
        assert engine_probe_config(smol, None, {"enforce_eager": False}) == compiled
        assert engine_probe_config(smol, None, {"compilation_config": {"mode": 3}}) == compiled
        assert engine_probe_config(smol, "combined", {"enforce_eager": False}) == combined
    assert engine_probe_config(smol, None, {}) == combined  # this machine's default mode


def test_a_config_never_calibrated_is_named_with_the_command_that_fixes_it(caplog):
    """The published-heads files record no calibration: ``uncalibrated`` says so and what to
    run; an engine resolving such a config logs it once at start-up (a guard, which hands the
    resolved config to its engine, does not log it a second time); shipped SmolLM2 is
    calibrated and silent."""
    import logging

    from guardrail.engine.install import engine_probe_config

    published = resolve_config("Qwen/Qwen2-1.5B-Instruct", None)
    note = published.uncalibrated
    assert note is not None and "'Qwen/Qwen2-1.5B-Instruct' was never calibrated" in note
    assert "guardrail calibrate --model MODEL --out DIR" in note
    assert resolve_config("HuggingFaceTB/SmolLM2-135M-Instruct", None).uncalibrated is None
    with caplog.at_level(logging.WARNING, logger="guardrail"):
        engine_probe_config("Qwen/Qwen2-1.5B-Instruct", None, {"enforce_eager": True})
        engine_probe_config("Qwen/Qwen2-1.5B-Instruct", published, {}, announce=False)
        engine_probe_config("HuggingFaceTB/SmolLM2-135M-Instruct", None, {})
    assert [r.getMessage() for r in caplog.records] == [f"guardrail: {note}"]


def test_guardrail_serve_for_a_model_with_no_config_says_what_to_run_before_starting(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "guardrail.integrations.serving", str(tmp_path / "my-model")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "guardrail-serve: no probe config for model" in out.stderr
    assert "--probe-config PATH" in out.stderr and "guardrail calibrate --model" in out.stderr
    assert "Traceback" not in out.stderr
