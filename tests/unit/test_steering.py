"""Steering math against independent references on synthetic tensors, and the vector files."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from guardrail.errors import ConfigError
from guardrail.steering import (
    Steering,
    SteeringBuildInfo,
    SteeringMetadata,
    SteeringVector,
    add_vector,
    adjust_rs,
    direction_from_pairs,
    load_steering_vector,
    packaged_steering_vectors,
    steering_delta,
)


def _unit(n: int, seed: int) -> torch.Tensor:
    u = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return u / u.norm()


def _stream(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)) * 3


def _vector(**overrides) -> SteeringVector:
    meta = {"name": "demo", "model_id": "org/model", "layer": 3, "hidden_size": 16}
    meta.update(avg_proj=1.25, num_layers=8, **overrides)
    return SteeringVector(SteeringMetadata(**meta), _unit(meta["hidden_size"], 0))


# -- math -----------------------------------------------------------------------------------------


def test_add_vector_matches_numpy_reference():
    s, u = _stream(7, 16, 1), _unit(16, 2)
    ref = s.double().numpy() + 2.5 * u.double().numpy()[None, :]
    np.testing.assert_allclose(add_vector(s, u, 2.5).numpy(), ref, rtol=0, atol=1e-5)


def test_adjust_rs_matches_per_row_reference():
    s, u, avg = _stream(9, 16, 3), _unit(16, 4), 4.75
    u64 = u.double().numpy()
    ref = np.stack([row + (avg - row @ u64) * u64 for row in s.double().numpy()])
    out = adjust_rs(s, u, avg)
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=1e-5)
    # every row's projection is now avg_proj, the orthogonal part is untouched
    np.testing.assert_allclose((out.double() @ u.double()).numpy(), avg, atol=1e-5)
    orth = s - (s @ u)[:, None] * u
    orth_out = out - (out @ u)[:, None] * u
    torch.testing.assert_close(orth_out, orth, rtol=0, atol=1e-5)


def test_adjust_rs_coefficient_scales_the_target_projection():
    s, u = _stream(3, 8, 5), _unit(8, 6)
    out = adjust_rs(s, u, avg_proj=2.0, coefficient=1.5)
    torch.testing.assert_close(out @ u, torch.full((3,), 3.0), rtol=0, atol=1e-5)


def test_delta_on_hidden_acts_on_the_stream_sum():
    """vLLM's layer output is (h, r) with stream h + r: the delta computed from h + r and added
    to h alone gives adjust_rs of the stream; computing it from r alone (a common bug) does not."""
    h, r, u, avg = _stream(5, 16, 7), _stream(5, 16, 8), _unit(16, 9), 3.0
    right = h + steering_delta(h + r, u, "adjust_rs", 1.0, avg)
    torch.testing.assert_close(right + r, adjust_rs(h + r, u, avg), rtol=0, atol=1e-5)
    wrong = r + steering_delta(r, u, "adjust_rs", 1.0, avg)
    assert not torch.allclose((h + wrong) @ u, torch.full((5,), avg), atol=1e-2)


def test_math_does_not_mutate_inputs_and_keeps_dtype():
    s, u = _stream(4, 8, 10).to(torch.bfloat16), _unit(8, 11)
    before = s.clone()
    out = adjust_rs(s, u, 1.0)
    assert torch.equal(s, before) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown steering method"):
        steering_delta(s, u, "rotate", 1.0, 0.0)  # type: ignore[arg-type]


def test_direction_from_pairs_matches_reference():
    with_i, without = _stream(12, 16, 12) + 1.0, _stream(12, 16, 13)
    u, avg = direction_from_pairs(with_i, without)
    diff = (with_i.double() - without.double()).mean(0).numpy()
    ref_u = diff / np.linalg.norm(diff)
    np.testing.assert_allclose(u.numpy(), ref_u, atol=1e-6)
    assert avg == pytest.approx(float((with_i.double().numpy() @ ref_u).mean()), abs=1e-5)
    with pytest.raises(ValueError, match="same mean"):
        direction_from_pairs(with_i, with_i)


# -- files ----------------------------------------------------------------------------------------


def test_file_round_trip(tmp_path):
    build = SteeringBuildInfo(dataset="bipia train (relative)", num_pairs=10, layer_scores={3: 0.5})
    vec = _vector(method="adjust_rs", coefficient=2.0, build=build)
    path = vec.save(tmp_path / "demo.steer.safetensors")
    loaded = SteeringVector.load(path)
    assert loaded.metadata == vec.metadata
    assert torch.equal(loaded.direction, vec.direction)
    assert loaded.fingerprint() == vec.fingerprint()
    assert str(tmp_path) not in path.read_bytes()[:4096].decode("utf-8", "replace")
    assert load_steering_vector(path).metadata.build == build


def test_mismatched_model_is_rejected_with_a_fix():
    vec = _vector()
    vec.check_model("org/model", 16, 8)
    for model_id, hidden, layers, what in [
        ("org/other", 16, 8, "model id"),
        ("org/model", 32, 8, "hidden size"),
        ("org/model", 16, 2, "layer 3"),
    ]:
        with pytest.raises(ConfigError, match=what) as info:
            vec.check_model(model_id, hidden, layers)
        assert "guardrail steer build" in str(info.value)


@pytest.mark.parametrize(
    ("tensors", "metadata", "message"),
    [
        ({"direction": torch.ones(16)}, None, "norm"),
        ({"direction": _unit(8, 0)}, None, "hidden_size 16"),
        ({"direction": _unit(16, 0).double()}, None, "dtype"),
        ({"direction": _unit(16, 0), "extra": torch.ones(1)}, None, "one tensor"),
        ({"direction": _unit(16, 0)}, {}, "metadata"),
        ({"direction": _unit(16, 0)}, {"guardrail_steering": "{}"}, "name: required field"),
    ],
)
def test_invalid_files_are_rejected(tmp_path, tensors, metadata, message):
    meta = SteeringMetadata(name="demo", model_id="m", layer=0, hidden_size=16, avg_proj=1.0)
    header = {"guardrail_steering": meta.model_dump_json()} if metadata is None else metadata
    path = tmp_path / "bad.steer.safetensors"
    save_file(tensors, str(path), metadata=header)
    with pytest.raises(ConfigError, match=message):
        SteeringVector.load(path)


def test_pickles_and_absolute_paths_are_refused(tmp_path):
    path = tmp_path / "vec.steer.safetensors"
    path.write_bytes(pickle.dumps({"direction": _unit(16, 0)}))
    with pytest.raises(ConfigError, match="invalid steering file"):
        SteeringVector.load(path)
    with pytest.raises(ValueError, match="absolute paths"):
        SteeringBuildInfo(dataset="/home/me/data.jsonl", num_pairs=1)
    with pytest.raises(ConfigError, match="no steering vector"):
        load_steering_vector("no-such-vector")


@pytest.mark.parametrize("name", sorted(packaged_steering_vectors()))
def test_every_shipped_vector_loads_and_is_documented(name):
    path = packaged_steering_vectors()[name]
    vec = SteeringVector.load(path)
    meta = vec.metadata
    assert meta.name == name and meta.num_layers is not None and meta.build is not None
    assert name == meta.model_id.split("/")[-1]
    assert meta.build.num_pairs > 0 and meta.layer in meta.build.layer_scores
    vec.check_model(meta.model_id, meta.hidden_size, meta.num_layers)
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    assert "/work" not in json.dumps(header) and "/home" not in json.dumps(header)


# -- strict, finite numbers and safe metadata (issue "Reliability and security", item 5) -------


@pytest.mark.parametrize(
    ("coefficient", "what"),
    [
        (math.nan, "coefficient = nan: must be a finite number"),
        (-math.inf, "coefficient = -inf: must be a finite number"),
        (True, "coefficient = True: must be a number, not bool"),
        ("2.0", "coefficient = '2.0': must be a number, not str"),
        (10**400, "too large for a float"),
    ],
)
def test_steering_coefficient_is_strict_and_finite(coefficient, what):
    with pytest.raises(ConfigError, match="invalid Steering: ") as built:
        Steering(vector="v", coefficient=coefficient)
    assert what in str(built.value) and isinstance(built.value, ValueError)
    with pytest.raises(ConfigError, match="invalid Steering: "):
        Steering.model_validate({"vector": "v", "coefficient": coefficient})
    assert Steering(vector="v", coefficient=2).coefficient == 2.0


META = {"name": "demo", "model_id": "m", "layer": 0, "hidden_size": 16, "avg_proj": 1.0}


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"coefficient": math.nan}, "coefficient = nan"),
        ({"avg_proj": math.inf}, "avg_proj = inf"),
        ({"avg_proj": "1.5"}, "avg_proj = '1.5'"),
        ({"layer": True}, "layer = True"),
        ({"layer": 1.0}, "layer = 1.0"),
        ({"hidden_size": "16"}, "hidden_size = '16'"),
        ({"num_layers": 2**64}, "num_layers = 18446744073709551616"),
        ({"schema_version": True}, "schema_version = True"),
        (
            {"build": {"dataset": "d", "num_pairs": 1, "layer_scores": {"3": math.nan}}},
            "build.layer_scores.3 = nan",
        ),
        (
            {"build": {"dataset": "d", "num_pairs": 1, "mean_difference_norm": -1}},
            "build.mean_difference_norm = -1",
        ),
        ({"build": {"dataset": "d", "num_pairs": True}}, "build.num_pairs = True"),
    ],
)
def test_metadata_numbers_are_strict_in_python_and_in_files(tmp_path, fields, where):
    with pytest.raises(ConfigError, match="invalid SteeringMetadata: ") as built:
        SteeringMetadata(**{**META, **fields})
    assert where in str(built.value)
    path = tmp_path / "bad.steer.safetensors"
    header = {"guardrail_steering": json.dumps({**META, **fields})}
    save_file({"direction": _unit(16, 0)}, str(path), metadata=header)
    with pytest.raises(ConfigError) as loaded:
        SteeringVector.load(path)
    assert f"invalid steering file {path}: invalid SteeringMetadata: " in str(loaded.value)
    assert where in str(loaded.value)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ('{"a": ' * 100_000, "nested too deeply"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"layer": ' + "1" * 5000 + "}", "cannot be read"),
        ("x" * 1_000_001, "over the 1000000 allowed"),
        ("not json", "not valid JSON: Expecting value at column 1"),
        ("[1, 2]", "Input should be a valid dictionary"),
        (
            '{"name": "demo", "model_id": "m", "layer": 0, "hidden_size": 16, "avg_proj": NaN}',
            "avg_proj = nan",
        ),
    ],
)
def test_broken_metadata_json_is_a_config_error_naming_the_file(tmp_path, metadata, message):
    path = tmp_path / "odd.steer.safetensors"
    save_file({"direction": _unit(16, 0)}, str(path), metadata={"guardrail_steering": metadata})
    with pytest.raises(ConfigError, match=message) as info:
        SteeringVector.load(path)
    assert str(path) in str(info.value)


def test_random_bytes_are_not_a_steering_file(tmp_path):
    path = tmp_path / "noise.steer.safetensors"
    path.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(ConfigError, match="invalid steering file"):
        SteeringVector.load(path)
