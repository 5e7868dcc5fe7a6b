"""Configuration: environment variables and options are checked, unknown EMBER_* names warned
about once, every option documented; the package imports without torch."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import ember
from ember import config as config_module

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "name, value, accepted",
    [
        ("EMBER_FUSION", "maybe", "a boolean"),
        ("EMBER_DEBUG", "2", "a boolean"),
        ("EMBER_BUFFER_POOL_MB", "lots", "an integer >= 0"),
        ("EMBER_BUFFER_POOL_MB", "-5", "an integer >= 0"),
        ("EMBER_COMPILE_THREADS", "1.5", "an integer >= 0"),
        ("EMBER_BACKEND", "cuda", "one of auto, cpp, triton"),
    ],
)
def test_a_bad_environment_value_is_an_error_naming_it(monkeypatch, name, value, accepted):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        config_module.load()
    assert name in str(info.value) and repr(value) in str(info.value) and accepted in str(info.value)
    with pytest.raises(ValueError, match=name):  # also before the first call, not at it
        ember.compile(lambda x: x + 1)


@pytest.mark.parametrize(
    "text, value", [("1", True), ("ON", True), (" yes ", True), ("0", False), ("off", False), ("", False)]
)
def test_boolean_words(monkeypatch, text, value):
    monkeypatch.setenv("EMBER_FUSION", text)
    assert config_module.load().fusion is value


def test_numbers_and_choices_from_the_environment(monkeypatch):
    monkeypatch.setenv("EMBER_BUFFER_POOL_MB", " 64 ")
    monkeypatch.setenv("EMBER_BACKEND", "triton")
    config = config_module.load()
    assert config.buffer_pool_mb == 64 and config.backend == "triton"


@pytest.mark.parametrize(
    "option, value", [("fusion", "no"), ("buffer_pool_mb", -1), ("buffer_pool_mb", True), ("backend", "gpu")]
)
def test_a_bad_option_is_an_error_naming_it(option, value):
    with pytest.raises(ValueError, match=f"{option}="):
        ember.compile(lambda x: x + 1, **{option: value})


def test_options_override_the_environment_and_paths_are_accepted(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_FUSION", "1")
    config = config_module.load(fusion=False, debug_dir=tmp_path)
    assert config.fusion is False and config.debug_dir == str(tmp_path)


def warnings_naming(variable: str, monkeypatch, loads: int) -> list[str]:
    """The warnings `loads` config loads give about `variable`, set to "1" in a process that has
    warned about nothing yet."""
    monkeypatch.setenv(variable, "1")
    monkeypatch.setattr(config_module, "_warned_unknown", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(loads):
            config_module.load()
    return [str(w.message) for w in caught if variable in str(w.message)]


def test_an_unknown_ember_variable_is_warned_about_once_with_a_suggestion(monkeypatch):
    messages = warnings_naming("EMBER_DEBGU", monkeypatch, loads=2)
    assert messages == ["ember ignores unknown environment variable EMBER_DEBGU; did you mean EMBER_DEBUG?"]


def test_the_suites_own_variables_are_not_unknown(monkeypatch):
    assert not warnings_naming("EMBER_TEST_DEVICE", monkeypatch, loads=1)


def test_every_option_is_in_the_readme_table():
    readme = (REPO / "README.md").read_text()
    pattern = r"^\| (\w+) \| (EMBER_\w+|—|-|\(none\))? ?\| ([^|]*)\|"
    rows = {m.group(1): (m.group(2), m.group(3).split()) for m in re.finditer(pattern, readme, re.M)}
    for f in dataclasses.fields(config_module.Config):
        assert f.name in rows, f"README.md's Configuration table has no row for option {f.name}"
        variable, default = rows[f.name]
        if f.metadata["env"]:
            assert variable == f.metadata["env"], f"README.md names the wrong variable for {f.name}"
        if type(f.default) in (bool, int):  # the default as its variable takes it: 0/1 for a flag
            assert default[:1] == [str(int(f.default))], f"README.md gives {f.name} the default {default}"


def test_import_and_version_do_not_import_torch():
    code = (
        "import sys, ember; from ember.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "import ember.frontend\n"
        "assert type(ember.metrics).__name__ == 'Metrics' and callable(ember.compile)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"ember {ember.__version__} (torch ")
