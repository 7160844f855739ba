"""A Python training script that builds transformers' ``TrainingArguments`` or a trl ``*Config`` (``--from
train.py``), read without running it (it would load models and data): ``ast`` finds the one call whose callee is
``TrainingArguments`` / ``Seq2SeqTrainingArguments`` (``transformers.TrainingArguments(...)`` too) or a ``*Config``
imported from trl, takes its keyword arguments whose values are literals (a name bound once in the file to a
literal is followed; ``torch.bfloat16`` is read as its name), and hands them to the TrainingArguments reader
(training_args.py). Every other argument is listed as not understood with its line. The model: the one string in
``*.from_pretrained("...")`` (tokenizers and processors aside), a trainer's ``model="..."`` or a module-level
``model_name = "..."``; several different ones, or none: give MODEL beside the file.

trl's configs change TrainingArguments' defaults (trl 1.16.0, https://github.com/huggingface/trl
trl/trainer/base_config.py ``_BaseConfig``: ``gradient_checkpointing=True``, ``bf16=None`` -> ``not fp16``;
sft_config.py, dpo_config.py, kto_config.py, reward_config.py: ``max_length=1024``); a keyword the script does not
give takes them, as the script's own object would (tests/test_training_script.py checks them against the
installed trl).
"""

from __future__ import annotations

import ast
from pathlib import Path

from memest.errors import MemestError
from memest.spec.trainers import common, training_args
from memest.spec.trainers.base import TrainerConfig

FORMAT = "training-script"
ARGS_CLASSES = ("TrainingArguments", "Seq2SeqTrainingArguments")  # transformers
# trl's defaults that differ from TrainingArguments' for the keys memest reads (trl 1.16.0; see above)
TRL_DEFAULTS = {"gradient_checkpointing": True}
TRL_MAX_LENGTH = {"SFTConfig": 1024, "DPOConfig": 1024, "KTOConfig": 1024, "RewardConfig": 1024}
MODEL_NAMES = ("model_name", "model_id", "model_name_or_path", "base_model", "model_path", "model_checkpoint")
NOT_MODELS = ("Tokenizer", "Processor", "FeatureExtractor")  # from_pretrained callees that load no model


def detect(path, data) -> bool:
    return data is None and Path(path).suffix.lower() == ".py"


def _callee(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _trl_names(tree: ast.Module) -> set[str]:
    """The names the file imports from trl (``from trl import SFTConfig``; ``import trl`` gives ``trl.X``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "trl":
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _is_args_call(node: ast.Call, trl: set[str]) -> bool:
    name = _callee(node)
    if name in ARGS_CLASSES:
        return True
    if not name.endswith("Config"):
        return False
    func = node.func
    return (isinstance(func, ast.Name) and name in trl) or (
        isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "trl")


def _bindings(tree: ast.Module) -> dict[str, ast.expr]:
    """Names bound exactly once in the file, by a plain ``name = value`` at module level: name -> value."""
    count: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            count[node.id] = count.get(node.id, 0) + 1
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            count[node.name] = count.get(node.name, 0) + 1
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if count.get(node.targets[0].id) == 1:
                out[node.targets[0].id] = node.value
    return out


class NotLiteral(Exception):
    pass


def literal(node: ast.expr, names: dict[str, ast.expr], depth: int = 0):
    """``node``'s value when it is a literal, a name bound once to one, ``torch.<dtype>`` (its name), or a
    list / tuple / dict of those; NotLiteral otherwise."""
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        pass
    if isinstance(node, ast.Name) and node.id in names and depth < 8:
        return literal(names[node.id], names, depth + 1)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
        return f"torch.{node.attr}"
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e, names, depth) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {literal(k, names, depth): literal(v, names, depth) for k, v in zip(node.keys, node.values, strict=True)}
    raise NotLiteral


def read(path, data=None) -> TrainerConfig:
    path = Path(path)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as exc:
        raise MemestError(f"--from {path}: not valid Python (line {exc.lineno}: {exc.msg})") from None
    trl = _trl_names(tree)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_args_call(n, trl)]
    if not calls:
        raise MemestError(f"--from {path}: no TrainingArguments(...) or trl *Config(...) call with keyword arguments "
                          "(an HfArgumentParser script reads them from its command line: save them with "
                          "args.to_json_string() and pass that JSON file)")
    if len(calls) > 1:
        where = ", ".join(f"{_callee(c)} at line {c.lineno}" for c in sorted(calls, key=lambda c: c.lineno))
        raise MemestError(f"--from {path}: several training-argument calls ({where}); memest reads one run: keep "
                          "one in a copy of the script, or dump the one you run with args.to_json_string()")
    call, names = calls[0], _bindings(tree)
    kind = _callee(call)
    values, skipped = {}, []
    for arg in call.args:
        skipped.append(f"(positional) {ast.unparse(arg)} (line {arg.lineno}: not a keyword)")
    for kw in call.keywords:
        if kw.arg is None:
            skipped.append(f"**{ast.unparse(kw.value)} (line {kw.value.lineno}: not read)")
            continue
        try:
            values[kw.arg] = literal(kw.value, names)
        except NotLiteral:
            skipped.append(f"{kw.arg} = {ast.unparse(kw.value)} (line {kw.value.lineno}: not a literal)")
    given = dict(values)
    if values.get("generation_batch_size") is not None and values.get("steps_per_generation") is not None:
        # trl 1.16.0 grpo_config.py __post_init__ raises the same (a dump holds both: training_args.py reads it)
        raise MemestError(f"--from {path}: {kind}(...) at line {call.lineno} gives both generation_batch_size and "
                          "steps_per_generation, which trl refuses ('can not be both configured at the same time'): "
                          "keep one")
    defaults = _trl_defaults(kind, values) if kind not in ARGS_CLASSES else {}
    cfg = training_args.read(path, {**defaults, **values})
    cfg.format = FORMAT
    cfg.mapping.insert(0, (f"{kind}(...) at line {call.lineno}", f"{len(given)} literal keyword argument(s) read"))
    if defaults:
        cfg.notes.append(f"{kind}'s own defaults (trl 1.16.0) where the script gives none: "
                         + ", ".join(f"{k}={v!r}" for k, v in defaults.items()))
    cfg.unknown += skipped
    if skipped:
        cfg.notes.append("an argument memest could not read took its default: give its memest flag beside --from")
    cfg.notes = [n for n in cfg.notes if not n.startswith("TrainingArguments do not name the model")]
    if kind not in ARGS_CLASSES and kind != "SFTConfig":  # DPOConfig, GRPOConfig, ...: the trainer's own step
        cfg.notes.append(f"{kind}: memest reads its TrainingArguments keys; the step it estimates is a supervised "
                         "one unless you say otherwise (DPO: --preference dpo)")
    _model(cfg, tree, names, path)
    return cfg


def _trl_defaults(kind: str, values: dict) -> dict:
    out = {k: v for k, v in TRL_DEFAULTS.items() if k not in values and "activation_checkpointing" not in values}
    if values.get("bf16") is None:
        out["bf16"] = not values.get("fp16", False)  # _BaseConfig.__post_init__
    if kind in TRL_MAX_LENGTH and "max_length" not in values and "max_seq_length" not in values:
        out["max_length"] = TRL_MAX_LENGTH[kind]
    return out


def _candidates(tree: ast.Module, names: dict) -> dict[str, list[str]]:
    """Every literal model name in the script -> where it is said."""
    found: dict[str, list[str]] = {}

    def add(node: ast.expr, where: str) -> None:
        try:
            value = literal(node, names)
        except NotLiteral:
            return
        if isinstance(value, str):
            found.setdefault(value, []).append(f"{where} (line {node.lineno})")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _callee(node) == "from_pretrained":
            owner = ast.unparse(node.func.value) if isinstance(node.func, ast.Attribute) else ""
            if any(word in owner for word in NOT_MODELS) or owner.startswith("Peft"):
                continue
            first = node.args[0] if node.args else next(
                (k.value for k in node.keywords if k.arg == "pretrained_model_name_or_path"), None)
            if first is not None:
                add(first, f"{owner}.from_pretrained")
        elif isinstance(node, ast.Call) and _callee(node).endswith("Trainer"):
            for kw in node.keywords:
                if kw.arg == "model":
                    add(kw.value, f"{_callee(node)}(model=...)")
    for name in MODEL_NAMES:
        for variant in (name, name.upper()):
            if variant in names:
                add(names[variant], variant)
    return found


def _model(cfg: TrainerConfig, tree: ast.Module, names: dict, path: Path) -> None:
    """The model the script loads, when it names exactly one as a literal; else ``cfg.no_model`` says why."""
    found = _candidates(tree, names)
    if len(found) != 1:
        listed = "; ".join(f"{v!r} ({', '.join(w)})" for v, w in found.items())
        cfg.no_model = (f"the script names several models ({listed}): pass the one to estimate as MODEL" if found
                        else "the script names no model as a literal (from_pretrained(\"...\"), model_name = "
                             "\"...\"): pass MODEL")
        cfg.notes.append(cfg.no_model)
        return
    (value, where), = found.items()
    try:
        common.model(cfg, where[0], value, path)
    except MemestError as exc:
        cfg.no_model = str(exc)
        cfg.notes.append(f"model {value!r} ({where[0]}): not readable here: pass MODEL beside --from")
