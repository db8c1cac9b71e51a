"""What the package declares. The fresh install itself is tested by `.ci/smoke`, which CI runs in an
empty virtual environment before the test extra is installed (train, save, resume)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _list(name: str) -> list[str]:
    """A list from pyproject.toml (`dependencies = [...]` or an extra `hf = [...]`), names only."""
    text = (ROOT / "pyproject.toml").read_text()
    body = re.search(rf"^{name} = \[(.*?)\]", text, re.S | re.M).group(1)
    return [re.split(r"[<>=!~ ]", item)[0] for item in re.findall(r'"([^"]+)"', body)]


def test_the_package_declares_what_saving_a_checkpoint_needs():
    assert {"torch", "safetensors", "numpy", "tqdm"} <= set(_list("dependencies"))  # safetensors saves via numpy


def test_the_hf_extra_brings_what_the_trainer_needs():
    assert {"transformers", "accelerate"} <= set(_list("hf"))


def test_ci_pins_the_integration_dependencies_of_the_test_extra():
    pins = dict(
        line.split("==")
        for line in (ROOT / "tests" / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    for name in _list("test"):
        assert name in pins, f"{name} (test extra) has no pin in tests/constraints.txt"
    assert "torch" not in pins  # installed first, as the README says (the CPU build)
