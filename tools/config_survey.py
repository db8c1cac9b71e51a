"""Survey: does zerotron load the DeepSpeed JSON configs found in the wild?

    python tools/config_survey.py DIR... [--list] [--deepspeed] [--json OUT] [--inline]

Walks each DIR for *.json files, keeps those that are DeepSpeed configs (a top-level object with
at least one of DeepSpeed's own keys: train_batch_size, train_micro_batch_size_per_gpu,
gradient_accumulation_steps, zero_optimization, fp16, bf16, optimizer, scheduler, ...), and loads
each with `zerotron.Config.load`. Prints how many load cleanly, load with warnings, or are
refused, and a table of the refusal reasons and of the warned keys.

Being fair to each config:
- world size: the data-parallel size the batch numbers imply when all three are given
  (train_batch_size / (micro x accumulation)), else 1; times tensor_parallel.autotp_size and
  pipeline.stages when those are numbers.
- "auto": resolved as the Hugging Face Trainer does with its default TrainingArguments
  (per-device batch 8, accumulation 1, lr 5e-5, betas (0.9, 0.999), eps 1e-8, weight decay 0,
  max_grad_norm 1.0, fp16/bf16 off, warmup 0, 1000 total steps, hidden size 768 for the ZeRO
  bucket sizes). Keys the Trainer does not fill stay "auto" (DeepSpeed refuses those too).
- files that are not JSON (shell templates with placeholders such as GB_SIZE) are counted apart:
  neither DeepSpeed nor zerotron can read them.
- fragments without any batch size (autotuning templates, inference snippets) are completed with
  train_micro_batch_size_per_gpu = 1 (DeepSpeed refuses them alone, as zerotron does) and marked.

--deepspeed also asks DeepSpeed's own `DeepSpeedConfig` (when `deepspeed` imports) whether it
accepts the same resolved dict at the same data-parallel size: a zerotron refusal of a config that
DeepSpeed's parser also refuses is not zerotron's fault. (Some of DeepSpeed's refusals only come at
`initialize`: 1-bit optimizers under ZeRO, `max_grad_norm` in optimizer params.)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # zerotron from this checkout

DS_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "fp16",
    "bf16",
    "bfloat16",
    "optimizer",
    "scheduler",
    "gradient_clipping",
    "activation_checkpointing",
)
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu")
# What the Hugging Face Trainer fills "auto" with, from default TrainingArguments.
HF_AUTO = dict(
    micro_batch_size=8,
    gradient_accumulation_steps=1,
    lr=5e-5,
    betas=[0.9, 0.999],
    eps=1e-8,
    weight_decay=0.0,
    max_grad_norm=1.0,
    fp16=False,
    bf16=False,
    warmup_steps=0,
    total_steps=1000,
    warmup_min_lr=0.0,
    hidden_size=768,
)


def find_configs(dirs, inline: bool = False):
    """(path, raw dict or None, why not) for every *.json under `dirs` that is (or looks like) a DeepSpeed config;
    `inline`: also the configs written in *.py and *.sh files (tools/config_inline.py), as PATH#N."""
    for top in dirs:
        for root, _, files in os.walk(top):
            for name in sorted(files):
                path = os.path.join(root, name)
                if inline and name.endswith((".py", ".sh")):
                    yield from _inline(path)
                if not name.endswith(".json"):
                    continue
                with open(path, errors="replace") as f:
                    text = f.read()
                try:
                    raw = json.loads(text)
                except json.JSONDecodeError:
                    # a template with placeholders still shows its DeepSpeed keys as text
                    if any(f'"{k}"' in text for k in DS_KEYS):
                        yield path, None, "not JSON (a template with placeholders)"
                    continue
                if isinstance(raw, dict) and (any(k in raw for k in DS_KEYS) or _fragment(raw)):
                    yield path, raw, None


def _inline(path: str):
    from tools.config_inline import python_configs, shell_configs

    with open(path, errors="replace") as f:
        text = f.read()
    if not any(f"{q}{k}{q}" in text for k in DS_KEYS for q in "\"'"):
        return
    if path.endswith(".py"):
        folder = os.path.dirname(path)
        others = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".py")]
        found, templates = python_configs(text, [open(o, errors="replace").read() for o in others if o != path]), 0
    else:
        found, templates = shell_configs(text)
    for i, raw in enumerate(found):
        yield f"{path}#{i}", raw, None
    for i in range(templates):
        yield f"{path}#template{i}", None, "a here-document still not JSON with its variables filled in"


def _fragment(raw: dict) -> bool:
    """A snippet of DeepSpeed sections alone (the docs' "flops_profiler": {...}): every key one of DeepSpeed's."""
    from zerotron.config.deepspeed import DEEPSPEED_TOP_LEVEL

    return bool(raw) and all(k in DEEPSPEED_TOP_LEVEL for k in raw)


def _int(value):
    return (
        value if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer() else None
    )


def world_size_for(raw: dict) -> int:
    tbs, mbs, gas = (
        _int(raw.get(k)) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    )
    dp = _int(raw.get("data_parallel_size")) or 1  # (DeepSpeed's AutoTP examples give it)
    if tbs and mbs and gas and tbs % (mbs * gas) == 0:
        dp = int(tbs // (mbs * gas))
    tp = (
        _int((raw.get("tensor_parallel") or {}).get("autotp_size", 1))
        if isinstance(raw.get("tensor_parallel"), dict)
        else 1
    )
    pp = _int((raw.get("pipeline") or {}).get("stages", 1)) if isinstance(raw.get("pipeline"), dict) else 1
    sp = _int(raw.get("sequence_parallel_size", 1))
    return dp * int(tp or 1) * int(pp or 1) * int(sp or 1), dp


def prepare(raw: dict) -> tuple[dict, bool]:
    """The dict to load (a fragment completed with a micro-batch size), and whether it was a fragment."""
    raw = json.loads(json.dumps(raw))
    fragment = not any(k in raw for k in BATCH_KEYS)
    if fragment:
        raw["train_micro_batch_size_per_gpu"] = 1
    return raw, fragment


def load_zerotron(raw: dict, world_size: int):
    """('load' | 'warn' | 'refused' | 'crash', [warning texts], reason)."""
    import zerotron

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        try:
            zerotron.Config.load(raw, world_size=world_size, **HF_AUTO)
        except zerotron.ConfigError as e:
            return "refused", [], f"{e.key}: {_short(e.fix)}"
        except Exception as e:  # anything but a ConfigError is a zerotron bug
            return "crash", [], f"{type(e).__name__}: {_short(str(e))}"
    texts = [str(w.message) for w in record if "zerotron" in str(w.message) or issubclass(w.category, UserWarning)]
    return ("warn" if texts else "load"), texts, None


def _shown(path: str, dirs) -> str:
    """`path` under the DIR it was found in, named by that DIR's last component."""
    for top in dirs:
        top = os.path.abspath(top)
        if os.path.abspath(path).startswith(top + os.sep):
            return os.path.join(os.path.basename(top), os.path.relpath(os.path.abspath(path), top))
    return path


def _short(text: str, n: int = 110) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def resolve_like_hf(raw: dict) -> dict:
    import zerotron

    try:
        return zerotron.resolve_auto(raw, **HF_AUTO)
    except Exception:
        return raw


def deepspeed_verdict(raw: dict, dp: int):
    """None if DeepSpeed's config parser accepts `raw` at data-parallel size `dp`, else its error."""
    try:
        import deepspeed.runtime.config as dsc
    except Exception as e:  # noqa: BLE001
        return f"deepspeed not importable ({type(e).__name__})"

    class Mpu:
        def get_data_parallel_world_size(self):
            return dp

    dsc.dist.get_rank = lambda *a, **k: 0
    try:
        dsc.DeepSpeedConfig(resolve_like_hf(raw), mpu=Mpu())
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {_short(str(e), 90)}"
    return None


def warned_keys(texts):
    out = []
    for t in texts:
        m = re.match(
            r"zerotron ignores these top-level config sections, which are neither DeepSpeed.s nor zerotron.s: (.*)", t
        )
        n = re.match(r"zerotron does not implement these DeepSpeed features and ignores their keys[^:]*: (.*)", t)
        if m:
            out += [f"unknown key {k.strip()}" for k in m.group(1).split(",")]
        elif n:
            out += [f"not implemented: {k.split(' (')[0].split(' = ')[0].strip()}" for k in n.group(1).split("; ")]
        else:
            out.append(_short(t, 100))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--list", action="store_true", help="print every file's outcome")
    ap.add_argument("--deepspeed", action="store_true", help="also ask DeepSpeed's DeepSpeedConfig")
    ap.add_argument("--json", help="write the per-file outcomes here")
    ap.add_argument("--inline", action="store_true", help="also configs written in .py and .sh files")
    args = ap.parse_args(argv)
    import logging

    logging.disable(logging.WARNING)  # DeepSpeed's own logging, when asked

    rows, templates, prepared_all = [], [], []
    for path, raw, why in find_configs(args.dirs, args.inline):
        rel = _shown(path, args.dirs)
        if raw is None:
            templates.append(rel)
            continue
        prepared, fragment = prepare(raw)
        world, dp = world_size_for(prepared)
        outcome, texts, reason = load_zerotron(prepared, world)
        row = dict(
            file=rel, world_size=world, fragment=fragment, outcome=outcome, warnings=warned_keys(texts), reason=reason
        )
        if args.deepspeed:
            row["deepspeed"] = deepspeed_verdict(prepared, dp) or "accepts"
        rows.append(row)
        prepared_all.append((resolve_like_hf(prepared), world))

    counts = collections.Counter(r["outcome"] for r in rows)
    print(
        f"DeepSpeed configs: {len(rows)} ({sum(r['fragment'] for r in rows)} fragments without a batch size, "
        f"completed with train_micro_batch_size_per_gpu=1); not JSON (templates): {len(templates)}"
    )
    print(
        f"  load: {counts['load']}   load with warnings: {counts['warn']}   refused: {counts['refused']}"
        f"   crashed (zerotron bug): {counts['crash']}"
    )
    if args.deepspeed:
        ds_ok = sum(r["deepspeed"] == "accepts" for r in rows)
        both = sum(r["deepspeed"] == "accepts" and r["outcome"] in ("refused", "crash") for r in rows)
        print(f"  DeepSpeed's parser accepts {ds_ok}; of those zerotron refuses {both}")

    refusals = collections.defaultdict(list)
    for r in rows:
        if r["outcome"] in ("refused", "crash"):
            refusals[r["reason"]].append(r)
    if refusals:
        print("\nrefusal reasons:")
        print("| n | reason | DeepSpeed's parser | example |" if args.deepspeed else "| n | reason | example |")
        print("|---|---|---|---|" if args.deepspeed else "|---|---|---|")
        for reason, rs in sorted(refusals.items(), key=lambda kv: -len(kv[1])):
            ds = ""
            if args.deepspeed:
                verdicts = collections.Counter("accepts" if r["deepspeed"] == "accepts" else "refuses" for r in rs)
                ds = " " + ", ".join(f"{v} {n}" for v, n in verdicts.items()) + " |"
            print(f"| {len(rs)} | {reason} |{ds} {rs[0]['file']} |")

    warned = collections.Counter(w for r in rows for w in set(r["warnings"]))
    if warned:
        print("\nwarnings (files):")
        for w, n in warned.most_common():
            print(f"  {n:3d}  {w}")
    if args.list:
        print("\nper file:")
        for r in rows:
            extra = r["reason"] or "; ".join(r["warnings"])
            ds = f"  [DeepSpeed: {r['deepspeed']}]" if args.deepspeed else ""
            print(
                f"  {r['outcome']:8s} w={r['world_size']:<4d}{' frag' if r['fragment'] else '     '} {r['file']}"
                f"  {extra}{ds}"
            )
        for t in templates:
            print(f"  template          {t}")
    from tools.config_keys import KEY_CLASSES, key_survey

    key_counts, key_examples = key_survey(prepared_all)
    print(
        f"\nkeys: {sum(key_counts.values())} in {len(rows)} configs: "
        + "   ".join(f"{c}: {key_counts[c]}" for c in KEY_CLASSES)
    )
    for c in ("silently ignored", "error", "warned", "no effect"):
        if key_examples[c]:
            print(f"  {c}: " + ", ".join(f"{p} ({n})" for p, n in key_examples[c].most_common(12)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "templates": templates}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
