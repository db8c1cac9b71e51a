"""Run a public training script unchanged, with what it would download or needs a GPU for answered locally.

    torchrun --nproc_per_node 2 tools/public_script.py STAND_INS SCRIPT.py ARGS...                 # real DeepSpeed
    zerotron run -n 2 --as-deepspeed tools/public_script.py STAND_INS SCRIPT.py ARGS...            # zerotron, alias
    zerotron run -n 2 --local-rank-arg tools/public_script.py rename,STAND_INS SCRIPT.py ARGS...   # zerotron, rename

STAND_INS is a comma-separated list of:
- `wikitext`: `datasets.load_dataset("wikitext", ...)` gives generated lines of words (HelloDeepSpeed);
- `roberta-base`: `AutoTokenizer.from_pretrained("roberta-base")` a word-level tokenizer with RoBERTa's special
  tokens (HelloDeepSpeed);
- `cifar10`: torchvision's CIFAR-10 gives seeded random 3 x 64 x 64 images and its transforms pass through;
  `torchvision.models.AlexNet` is torchvision's AlexNet architecture (this machine has no CPU torchvision build)
  (pipeline_parallelism);
- `imagenet`: `cifar10`'s, with torchvision's `resnet18` architecture and `datasets.FakeData` as seeded random
  3 x 32 x 32 images, at most 64 (training/imagenet's `--dummy` data; tools/public_imagenet.py);
- `celeba`: `cifar10`'s, and torchvision's ImageFolder (the GAN's celeba) gives the same random images and
  `torchvision.utils.save_image` writes nothing (gan);
- `cpu`: when there is no GPU, `torch.cuda.set_device` does nothing (pipeline_parallelism, BingBertSquad call it
  unguarded) and a process group asked for with the "nccl" backend is made with "gloo" (BingBertSquad's
  `deepspeed.init_distributed(dist_backend='nccl')`).
- `alpaca`: `datasets.load_dataset("tatsu-lab/alpaca")` gives 64 generated instruction / input / output records of
  words in its "train" split (SuperOffload's and ZenFlow's fine-tuning scripts);
- `seed`: torch's random generator is seeded with 0 when `deepspeed.initialize` returns, so the random inputs a
  script draws after it are the same under both engines (DeepSpeed leaves each process's generator seeded at
  random; AutoTP's examples train on `torch.randint` tokens).
- `rename` (or `rename:DIR`, DIR a directory holding the script and the packages it imports, such as
  DeepSpeed-Chat's dschat/): the first way in. The script's directory (or DIR) is copied to a temporary directory
  with every DeepSpeed import in its .py files edited as a user edits them (`import zerotron as deepspeed`,
  `from zerotron.X import Y`: tools/deepspeed_rename.py), rank 0 prints each edit after a line
  `RENAMED <count> import lines`, and the copy runs; PYTHONPATH entries inside DIR point into the copy. Run it
  without the alias (no --as-deepspeed); the stand-ins use zerotron where they would use `deepspeed`.

Every loss the script computes with `torch.nn.functional.cross_entropy` or `binary_cross_entropy`
(`CrossEntropyLoss`, `BCELoss`, a Transformers model's loss) with gradients on is recorded; each rank that
computed some prints them as JSON on a line starting with LOSSES. `import deepspeed` in the script is the
installed one: real DeepSpeed, or zerotron under the alias (in rename mode there is none: a line says so if
unedited code, a library, imported a real DeepSpeed anyway). DeepSpeed's launcher puts --local_rank=N first: it
goes to the script, before the script's own arguments.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import random
import runpy
import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
WORDS = [f"w{i}" for i in range(300)]
LOSSES: list[float] = []
ENGINE = "deepspeed"  # what the script's DeepSpeed imports give: "zerotron" in rename mode


def word_lines(lines: int, seed: int = 0) -> list[str]:
    """Lines of words, each word mostly followed by the next one: text a small model learns from."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        w, words = rng.randrange(len(WORDS)), []
        for _ in range(rng.randrange(6, 30)):
            words.append(WORDS[w])
            w = (w + 1) % len(WORDS) if rng.random() < 0.8 else rng.randrange(len(WORDS))
        out.append(" ".join(words))
    return out


def word_tokenizer(specials: dict[str, str], max_length: int | None = None, template: bool = False):
    """A word-level fast tokenizer over WORDS; `specials`: the tokenizer's special tokens by role (bos_token=...),
    given the first ids in order; `template`: wrap each text in bos ... eos, as RoBERTa's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    names = list(dict.fromkeys(specials.values()))
    vocab = {w: i for i, w in enumerate(names + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=specials.get("unk_token", names[0])))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if template:
        bos, eos = specials["bos_token"], specials["eos_token"]
        core.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])]
        )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **specials)
    if max_length:
        tokenizer.model_max_length = max_length
    return tokenizer


class _RandomCifar(torch.utils.data.Dataset):
    def __init__(self, root=None, train=True, download=False, transform=None, n=256):
        g = torch.Generator().manual_seed(0 if train else 1)
        self.images, self.labels = torch.randn(n, 3, 64, 64, generator=g), torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


class _AlexNet(torch.nn.Module):
    """torchvision's AlexNet: five convolutions, an adaptive 6 x 6 pool, three linear layers with dropout."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        # ALEXNET_DROPOUT=0: each engine's random stream draws the masks; without them losses can be compared
        dropout = float(os.environ.get("ALEXNET_DROPOUT", dropout))
        nn = torch.nn
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        )  # fmt: skip
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(256 * 36, 4096), nn.ReLU(inplace=True),
            nn.Dropout(dropout), nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Linear(4096, num_classes),
        )  # fmt: skip

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def _wikitext():
    import datasets

    load_dataset = datasets.load_dataset

    def local(path, *args, **kwargs):
        if path == "wikitext":
            return datasets.Dataset.from_dict({"text": [line + "\n" for line in word_lines(400)]})
        return load_dataset(path, *args, **kwargs)

    datasets.load_dataset = local


def _alpaca():
    import datasets

    load_dataset = datasets.load_dataset

    def local(path, *args, **kwargs):
        if path == "tatsu-lab/alpaca":
            lines = word_lines(192)
            records = {"instruction": lines[0::3], "input": [line[:20] for line in lines[1::3]], "output": lines[2::3]}
            records["input"][::2] = [""] * len(records["input"][::2])  # (half of Alpaca's records have no input)
            return datasets.DatasetDict({"train": datasets.Dataset.from_dict(records)})
        return load_dataset(path, *args, **kwargs)

    datasets.load_dataset = local


def _roberta_base():
    import transformers

    roles = dict(bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>", mask_token="<mask>")
    directory = Path(tempfile.mkdtemp(prefix="roberta-stand-in-"))
    word_tokenizer({**roles, "cls_token": "<s>", "sep_token": "</s>"}, template=True).save_pretrained(directory)
    from_pretrained = transformers.AutoTokenizer.from_pretrained

    def local(name, *args, **kwargs):
        return from_pretrained(directory if name == "roberta-base" else name, *args, **kwargs)

    transformers.AutoTokenizer.from_pretrained = local


def _cifar10():
    identity = lambda *a, **k: (lambda x: x)  # noqa: E731
    transforms = types.ModuleType("torchvision.transforms")
    for name in ("Compose", "Resize", "CenterCrop", "ToTensor", "Normalize"):
        setattr(transforms, name, identity)
    models = types.ModuleType("torchvision.models")
    models.AlexNet, models.vgg19 = _AlexNet, None
    module = types.ModuleType("torchvision")
    module.datasets, module.transforms, module.models = types.SimpleNamespace(CIFAR10=_RandomCifar), transforms, models
    sys.modules.update({"torchvision": module, "torchvision.transforms": transforms, "torchvision.models": models})


def _cpu():
    if not torch.cuda.is_available():
        torch.cuda.set_device = lambda *a, **k: None
        torch.cuda.reset_peak_memory_stats = lambda *a, **k: None  # (bf16_master_weight calls it unguarded)
        torch.cuda.synchronize = lambda *a, **k: None  # (the GAN's timing)
        torch.Tensor.cuda = lambda self, *a, **k: self  # (imagenet's loss record: torch.empty(epochs).cuda())
        torch.cuda.nvtx.range_push = torch.cuda.nvtx.range_pop = lambda *a, **k: None  # (bing_bert's BERT)
        init_process_group = torch.distributed.init_process_group

        def gloo(backend=None, *args, **kwargs):
            return init_process_group("gloo" if backend == "nccl" else backend, *args, **kwargs)

        torch.distributed.init_process_group = gloo


def _seed():
    deepspeed = importlib.import_module(ENGINE)
    initialize = deepspeed.initialize

    def seeded(*args, **kwargs):
        out = initialize(*args, **kwargs)
        torch.manual_seed(0)
        return out

    deepspeed.initialize = seeded


def _imagenet():
    from public_imagenet import install

    _cifar10()
    install(sys.modules["torchvision"])


def _celeba():
    _cifar10()
    torchvision = sys.modules["torchvision"]
    torchvision.datasets.ImageFolder = _RandomCifar
    utils = types.ModuleType("torchvision.utils")
    utils.save_image = lambda *a, **k: None
    torchvision.utils = sys.modules["torchvision.utils"] = utils
    sys.modules["torchvision.datasets"] = torchvision.datasets
    sys.modules["torchvision.transforms"] = torchvision.transforms


STAND_INS = {
    "wikitext": _wikitext,
    "alpaca": _alpaca,
    "roberta-base": _roberta_base,
    "cifar10": _cifar10,
    "celeba": _celeba,
    "imagenet": _imagenet,
    "cpu": _cpu,
    "seed": _seed,
}


def recorded(loss_fn):
    """torch's `loss_fn`, appending each loss computed with gradients on to LOSSES (at full precision):
    CrossEntropyLoss / BCELoss and Transformers' causal-LM loss call these functions."""

    def record(input, target, *args, **kwargs):
        loss = loss_fn(input, target, *args, **kwargs)
        if torch.is_grad_enabled() and loss.numel() == 1:
            LOSSES.append(loss.item())
        return loss

    return record


def renamed(script: str, root: str) -> str:
    """Rename mode: `root` (default: the script's directory) copied to a temporary directory with its DeepSpeed
    imports renamed to zerotron's (tools/deepspeed_rename.py), every edit printed by rank 0; `sys.path` entries
    inside `root` (PYTHONPATH's) point into the copy. Returns the copied script's path."""
    global ENGINE
    from deepspeed_rename import rename_tree

    if os.environ.get("ZEROTRON_AS_DEEPSPEED", "").strip().lower() not in ("", "0", "false", "no", "off"):
        sys.exit("public_script.py rename: runs without the alias; unset ZEROTRON_AS_DEEPSPEED (no --as-deepspeed)")
    script_path = Path(script).resolve()
    top = Path(root).resolve() if root else script_path.parent
    temporary = tempfile.mkdtemp(prefix="renamed-")
    atexit.register(shutil.rmtree, temporary, ignore_errors=True)
    copy = Path(temporary) / top.name
    edits = rename_tree(top, copy)
    if os.environ.get("RANK", "0") == "0":
        print(f"RENAMED {len(edits)} import lines of {top} in {copy}", flush=True)
        for file, line, old, new in edits:
            print(f"  {file}:{line}: {old.strip()}  ->  {new.strip()}", flush=True)
    inside = lambda p: Path(p).resolve().is_relative_to(top)  # noqa: E731
    sys.path = [str(copy / Path(p).resolve().relative_to(top)) if p and inside(p) else p for p in sys.path]
    ENGINE = "zerotron"
    return str(copy / script_path.relative_to(top))


def main() -> None:
    launcher = [a for a in sys.argv[1:3] if a.startswith("--local_rank")]
    names, script, *args = [a for a in sys.argv[1:] if a not in launcher]
    names = names.split(",")
    for name in [n for n in names if n.partition(":")[0] == "rename"]:
        script = renamed(script, name.partition(":")[2])
    for name in names:
        if name.partition(":")[0] != "rename":
            STAND_INS[name]()
    for name in ("cross_entropy", "binary_cross_entropy"):
        setattr(torch.nn.functional, name, recorded(getattr(torch.nn.functional, name)))
    sys.argv = [script, *launcher, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:  # (also when the script fails after training: ZenFlow's saves its checkpoint on rank 0 alone)
        import torch.distributed as dist

        if LOSSES:  # (a pipeline computes them on its last stage)
            print(f"LOSSES rank {dist.get_rank() if dist.is_initialized() else 0} " + json.dumps(LOSSES), flush=True)
        if ENGINE == "zerotron" and "deepspeed" in sys.modules:  # code left unedited (a library) imported it
            print(f"RENAMED but `deepspeed` was imported too: {sys.modules['deepspeed'].__file__}", flush=True)


if __name__ == "__main__":
    main()
