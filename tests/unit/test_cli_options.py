"""The subcommands' shared options become the library's typed settings without changing the
parsed arguments; the score cache serves its rows and refuses a mismatch before any engine
starts; ``guardrail.cli.common``, the old import path, still gives its public names."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

import guardrail.cli.common as common
from guardrail.cli import build_parser, options, output
from guardrail.errors import GuardrailError
from guardrail.offline import datasets, row_scores
from guardrail.offline.datasets import LabelledPair, ScoreTable, content_key
from guardrail.offline.row_scores import ScoringSettings, scores_for
from guardrail.probe.config import read_model_config
from guardrail.probe.scoring import ATTENTION_STATS

COMBINED = Path(__file__).parents[2] / "model_configs" / "SmolLM2-135M-Instruct.combined.json"

OLD_NAMES = {
    "ScoringSettings": row_scores,
    "add_data_argument": options,
    "add_engine_arg": options,
    "add_model_arguments": options,
    "config_focus": row_scores,
    "count": output,
    "layers_read_by": row_scores,
    "open_engine": row_scores,
    "read_rows": datasets,
    "resolve_model": options,
    "score_pairs": row_scores,
    "scores_for": row_scores,
    "write_json": output,
}


def test_the_old_import_path_gives_the_same_objects():
    assert set(common.__all__) == set(OLD_NAMES)
    for name, home in OLD_NAMES.items():
        assert getattr(common, name) is getattr(home, name), name


def _threshold_args(*extra: str):
    argv = ["threshold", "--config", "c.json", "--out", "o.json", "--data", "d.jsonl"]
    return build_parser().parse_args([*argv, *extra])


def test_settings_read_the_layers_the_configs_need_and_leave_the_args_alone():
    config = read_model_config(COMBINED)
    last, means = config.hidden_layers_at("last"), config.hidden_layers_at("data_mean")
    assert last or means  # the shipped combined config reads hidden states
    args = _threshold_args("--batch-size", "8", "--engine-arg", "dtype=bfloat16")
    before = copy.deepcopy(vars(args))
    settings = options.scoring_settings(args, [config])
    assert vars(args) == before
    assert (settings.hidden_layers, settings.data_mean_layers) == (tuple(last), tuple(means))
    assert settings.batch_size == 8 and dict(settings.engine_args) == {"dtype": "bfloat16"}
    given = options.scoring_settings(_threshold_args("--hidden-layers", "3"), [config])
    assert given.hidden_layers == (3,) and given.data_mean_layers == tuple(means)


def _pairs() -> list[LabelledPair]:
    return [LabelledPair(f"r{i}", "Sum up.", f"Text number {i}.", i % 2) for i in range(3)]


def _cache(path: Path, pairs: list[LabelledPair], model: str = "m") -> ScoreTable:
    heads = [(0, 0), (0, 1)]
    values = np.arange(len(pairs) * len(heads) * len(ATTENTION_STATS), dtype=float)
    table = ScoreTable(
        model,
        heads,
        [content_key(p) for p in pairs],
        values.reshape(len(pairs), len(heads), len(ATTENTION_STATS)),
        np.array([10, 11, 12][: len(pairs)]),
        np.array([4, 5, 6][: len(pairs)]),
        hidden={1: np.ones((len(pairs), 2), dtype=np.float32)},
    )
    table.save(path)
    return table


def test_cached_rows_are_served_in_the_callers_order_without_an_engine(tmp_path):
    pairs = _pairs()
    cached = _cache(tmp_path / "s.npz", pairs)
    asked = [pairs[2], pairs[0]]
    settings = ScoringSettings(scores_cache=tmp_path / "s.npz", hidden_layers=(1,))
    kept, table, skipped, _ = scores_for(asked, "m", "all", settings)  # engine=None: none started
    assert kept == asked and skipped == []
    np.testing.assert_array_equal(table.values, cached.values[[2, 0]])
    np.testing.assert_array_equal(table.data_tokens, [6, 4])


@pytest.mark.parametrize(
    ("model", "settings", "message"),
    [
        ("other", {}, "holds scores of 'm', not 'other'"),
        ("m", {"hidden_layers": (2,)}, r"hidden states of layers \[1\], not the \[2\]"),
        ("m", {"data_mean_layers": (1,)}, r"data-mean states of layers \[\], not the \[1\]"),
    ],
)
def test_a_cache_that_does_not_fit_is_refused_before_scoring(tmp_path, model, settings, message):
    pairs = _pairs()
    _cache(tmp_path / "s.npz", pairs)
    with pytest.raises(GuardrailError, match=message):
        scores_for(
            pairs, model, "all", ScoringSettings(scores_cache=tmp_path / "s.npz", **settings)
        )
