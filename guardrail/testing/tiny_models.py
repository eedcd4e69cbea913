"""Tiny random-initialised chat models for fast tests, built locally in seconds.

vLLM cannot download anything here, so tests need models made on the spot: a byte-level BPE
tokenizer trained on a built-in corpus, a ChatML chat template, and a Llama or Qwen2 config with
random weights, saved as safetensors. Scores from such a model are meaningless as detection, but
every code path (GQA, RoPE, chunked prefill, prefix caching, chat templates, offsets) is real.

Example:
    >>> path = build_tiny_model("/tmp/tiny-llama", arch="llama")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "and",
    "in",
    "is",
    "you",
    "are",
    "your",
    "for",
    "on",
    "with",
    "as",
    "by",
    "this",
    "that",
    "it",
    "be",
    "or",
    "from",
    "at",
    "not",
    "email",
    "assistant",
    "user",
    "system",
    "question",
    "answer",
    "data",
    "document",
    "table",
    "code",
    "please",
    "summarize",
    "ignore",
    "previous",
    "instruction",
    "instructions",
    "output",
    "print",
    "write",
    "reply",
    "send",
    "translate",
    "password",
    "invoice",
    "paid",
    "amount",
    "charged",
    "card",
    "account",
    "company",
    "meeting",
    "schedule",
    "report",
    "result",
    "value",
    "function",
    "return",
    "error",
    "python",
    "java",
    "import",
    "class",
    "def",
    "list",
    "string",
    "number",
    "file",
    "read",
    "open",
    "row",
    "column",
    "name",
    "city",
    "year",
    "total",
    "price",
    "country",
    "team",
    "score",
    "game",
    "date",
    "rank",
    "hello",
    "world",
    "good",
    "bad",
    "yes",
    "no",
    "what",
    "which",
    "who",
    "when",
    "where",
    "why",
    "how",
    "find",
    "all",
    "any",
    "some",
    "one",
    "two",
]

Arch = Literal["llama", "qwen2"]


def _corpus(n_lines: int = 400) -> list[str]:
    lines = []
    for i in range(n_lines):
        words = [_WORDS[(i * 7 + j * 13) % len(_WORDS)] for j in range(12)]
        lines.append(" ".join(words).capitalize() + f". {i} {i * 37 % 1000}!?")
    return lines


def _train_tokenizer(out_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        unk_token=None,
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out_dir))


def _model_config(arch: Arch, vocab_size: int, eos_id: int) -> dict[str, object]:
    common: dict[str, object] = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,  # head_dim 32: a size vLLM's CPU attention supports
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": eos_id,
        "bos_token_id": eos_id,
    }
    if arch == "llama":
        return {**common, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    return {**common, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    arch: Arch = "llama",
    seed: int = 0,
    vocab_size: int = 1024,
    overrides: dict[str, object] | None = None,
    qk_std: float = 0.2,
) -> Path:
    """Build (or reuse) a tiny random chat model with a local tokenizer at ``out_dir``.

    The directory is written atomically (built in a temporary sibling, then renamed), so
    concurrent builders never see a half-written model. Returns the model directory.
    ``overrides`` replace entries of the model config (sizes, ``torch_dtype``: e.g. a head size
    GPU attention kernels support, saved in float16). ``qk_std`` is the standard deviation of
    the query and key projections: ten times the usual 0.02 by default, so attention is far
    from uniform and scores differ by head; a lower one keeps the attention logits small enough
    for float16 to stay close to float32 (the GPU parity tests).

    Example:
        >>> build_tiny_model("/tmp/tiny-qwen2", arch="qwen2").name  # doctest: +SKIP
        'tiny-qwen2'
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _train_tokenizer(tmp, vocab_size)
        eos_id = json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"]["<|im_end|>"]
        cfg_dict = {**_model_config(arch, vocab_size, eos_id), **(overrides or {})}
        config = AutoConfig.for_model(str(cfg_dict.pop("model_type")), **cfg_dict)
        torch.manual_seed(seed)
        dtype = getattr(torch, str(cfg_dict["torch_dtype"]))
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
        # Larger-than-default init so attention is far from uniform and scores differ by head.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    param.normal_(0.0, qk_std)
        model.save_pretrained(str(tmp), safe_serialization=True)
        (tmp / "generation_config.json").write_text(
            json.dumps({"eos_token_id": eos_id, "bos_token_id": eos_id, "do_sample": False})
        )
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
