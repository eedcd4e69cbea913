"""``guardrail steer build`` on the tiny model: the written vector equals one recomputed from
Hugging Face hidden states of the same prompts, and the layer search covers every candidate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from guardrail.cli import main
from guardrail.cli.steer import layer_list
from guardrail.offline.datasets import LabelledPair
from guardrail.offline.steering_examples import CANARIES, make_examples, select_examples
from guardrail.steering import SteeringVector, direction_from_pairs
from tests.helpers import _load

WORDS = "the invoice lists the amount paid on the date for the account of the supplier".split()


def _rows(path: Path, n: int = 12) -> Path:
    with path.open("w") as f:
        for i in range(n):
            data = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(20 + i)) + "."
            row = {
                "id": f"r{i}",
                "task": "ab"[i % 2],
                "source_index": i,
                "instruction": f"Answer question {i} about the document.",
                "data": data,
                "label": 0,
                "ideal": f"The amount is {i * 10} dollars.",
            }
            f.write(json.dumps(row) + "\n")
    return path


def test_examples_carry_a_checkable_canary():
    pairs = [LabelledPair(f"r{i}", "Sum up.", f"Text {i}. More text.", 0) for i in range(6)]
    pairs.append(LabelledPair("x", "Sum up.", "Injected already.", 1))  # skipped
    examples = make_examples(pairs)
    assert len(examples) == 6
    assert {e.canary for e in examples} == {c for _, _, c in CANARIES}
    for example in examples:
        assert example.canary not in example.data.lower()
        assert example.canary.split("-")[0] in example.injected.lower()
        assert example.followed_injection(example.compliant)
        assert not example.followed_injection("The invoice total is 20 dollars.")
    assert examples[0].request(True, with_instruction=False) == [
        {"role": "user", "content": "Data: " + examples[0].injected}
    ]
    assert layer_list("6:27:3") == [6, 9, 12, 15, 18, 21, 24] and layer_list("1,3") == [1, 3]


def test_steer_build_writes_a_vector_equal_to_an_hf_recomputation(
    tiny_engine, tiny_llama_dir, tmp_path
):
    data = _rows(tmp_path / "rows.jsonl")
    argv = ["steer", "build", "--data", str(data), "--out", str(tmp_path / "out")]
    argv += ["--layers", "1,2", "--train-per-task", "4", "--validation-per-task", "2"]
    assert main(argv, engine=tiny_engine) == 0
    vector = SteeringVector.load(tmp_path / "out" / "tiny.steer.safetensors")
    meta = vector.metadata
    assert meta.model_id == tiny_engine.config.model_id and meta.layer in (1, 2)
    assert set(meta.build.layer_scores) == {1, 2} and meta.build.num_pairs == 16
    assert str(tmp_path) not in meta.model_dump_json()
    assert tiny_engine.steering_vectors == {}  # the candidates were unloaded

    # independent recomputation: HF hidden states of the same rendered prompts
    train, _, _ = select_examples([data], train_per_task=4, validation_per_task=2)
    model = _load(str(tiny_llama_dir))
    streams: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    for example in train:
        for injected in (False, True):
            for side in (True, False):
                ids = tiny_engine.prepare(example.request(injected, side)).token_ids
                with torch.no_grad():
                    hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
                streams[side].append(hidden[meta.layer + 1][0, -1])
    u, avg_proj = direction_from_pairs(torch.stack(streams[True]), torch.stack(streams[False]))
    torch.testing.assert_close(vector.direction, u, atol=1e-4, rtol=0)
    assert meta.avg_proj == pytest.approx(avg_proj, abs=1e-3)
