"""Where a run's configuration comes from: the presets, the main job's extras, a TOML file,
``--set`` overrides and the explicit CLI flags, in that order, each mistake one line.

:func:`build_config` composes them onto :class:`~ddiloco.settings.config.Config`'s defaults (later
layers win); the dataclasses and their checks are ``config.py``'s.
"""

from __future__ import annotations

import enum
import tomllib
import types
import typing
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Mapping

from ddiloco.core.shared.errors import ConfigError
from ddiloco.settings.config import Config
from ddiloco.settings.did_you_mean import did_you_mean

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # Seconds on 2 CPU cores: for smoke tests and CI.
    "tiny": {
        "model": {"seq_len": 32, "d_model": 32, "n_layers": 2, "n_heads": 2},
        "train": {"batch_size": 8, "lr": 3e-3, "warmup_steps": 5, "eval_batches": 2, "evals": 4,
                  "corpus_max_bytes": 2**20, "threads": 1},
        "protocol": {"fragments": 3, "period": 6},
        "run": {"tokens": 4 * 48 * 8 * 32},
    },
    # A minute or two per run: the benchmarks' sweeps and multi-seed comparisons.
    "small": {
        "model": {"seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4},
        "train": {"batch_size": 16},
        "run": {"tokens": 4 * 400 * 16 * 64},
    },
    # The main job: about 3 minutes on 2 CPU cores (README).
    "default": {
        "model": {"seq_len": 128, "d_model": 128, "n_layers": 4, "n_heads": 4},
        "train": {"batch_size": 16},
        "run": {"tokens": 4 * 300 * 16 * 128},
    },
}


MAIN_JOB: dict[str, dict[str, dict[str, Any]]] = {
    # What ``ddiloco run`` adds to each preset so that its first run shows what Decoupled
    # DiLoCo is for: a seeded failure trace (seed 0: each learner fails once or twice in the
    # run's virtual time; 3 times on average over seeds) and one learner in four on the
    # ~18% slower hardware generation. Not part of the presets: ``compare``, the benchmarks
    # and the tests keep the failure-free, uniform cluster unless they ask for failures.
    # ``--mtbf 0`` and ``--set cluster.slow_fraction=0`` turn them off.
    "tiny": {"faults": {"mtbf_s": 15.0, "downtime_s": 4.0}, "cluster": {"slow_fraction": 0.25}},
    "small": {"faults": {"mtbf_s": 120.0, "downtime_s": 20.0}, "cluster": {"slow_fraction": 0.25}},
    "default": {"faults": {"mtbf_s": 90.0, "downtime_s": 15.0}, "cluster": {"slow_fraction": 0.25}},
}


PROCESSES_TIME_S: dict[str, float] = {"tiny": 30.0}
"""What ``ddiloco run --runtime processes`` trains for when no budget is given, by preset: a training
time (its clock starts when the first learner joins), not the preset's tokens. The tiny preset's
49,152 tokens were spent in 1-2 s of training, before a round could merge on a busy 2-core
machine: eval loss 4.997 and goodput 5% at a load of 5.5 (issue 57). Presets not listed keep their
tokens (minutes of training)."""


def unknown_keys(sections: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The sections and ``section.key`` names in ``sections`` (a configuration as a dict) that this
    version's :class:`Config` has no field for: what a newer ddiloco wrote and this one cannot honour."""
    defaults = Config()
    found = []
    for section, values in sections.items():
        if section not in {f.name for f in fields(Config)}:
            found.append(section)
            continue
        known = {f.name for f in fields(getattr(defaults, section))}
        found += [f"{section}.{key}" for key in values if key not in known]
    return sorted(found)


def apply_section(config: Config, section: str, values: Mapping[str, Any], *, origin: str) -> Config:
    """Return ``config`` with ``values`` set in ``section``, type-checked against the fields."""
    if section not in {f.name for f in fields(Config)}:
        raise ConfigError(f"{origin}: unknown section {section!r}"
                          + did_you_mean(section, [f.name for f in fields(Config)], "sections"))
    current = getattr(config, section)
    hints = typing.get_type_hints(type(current))
    known = {f.name for f in fields(current)}
    changes = {}
    for key, value in values.items():
        if key not in known:
            everywhere = [f"{s.name}.{k.name}" for s in fields(Config) for k in fields(getattr(config, s.name))]
            raise ConfigError(f"{origin}: unknown key {section}.{key}"
                              + did_you_mean(f"{section}.{key}", everywhere, f"keys of [{section}]", sorted(known)))
        changes[key] = _coerce(f"{section}.{key}", value, hints[key], origin)
    return replace(config, **{section: replace(current, **changes)})


def config_of_sync(run_config: Mapping[str, Mapping[str, Any]] | None) -> Config:
    """The synchronizer's own configuration, from the sections its probe or its checkpoint carries."""
    config = Config()
    for section, values in (run_config or {}).items():
        config = apply_section(config, section, values, origin="the synchronizer's configuration")
    return config.validate()


def _coerce(key: str, value: Any, hint: Any, origin: str) -> Any:
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise ConfigError(f"{origin}: {key}: unknown value {value!r} "
                              f"(choose from {', '.join(str(m.value) for m in hint)})") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, hint) or (hint is not bool and isinstance(value, bool)):
        raise ConfigError(f"{origin}: {key} must be {hint.__name__}, got {value!r}")
    return value


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML file's tables; a missing, unreadable or malformed ``what`` file is one ConfigError."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read {what} file {path}: {err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{what} file {path} is not valid TOML: {err}") from None


def load_toml(config: Config, path: str | Path) -> Config:
    data = read_toml(path, "config")
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section]")
        config = apply_section(config, section, values, origin=str(path))
    return config


def apply_override(config: Config, assignment: str) -> Config:
    """Apply one ``section.key=value``; the value is read as TOML, else as a bare string."""
    name, sep, raw = assignment.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {assignment!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return apply_section(config, section, {key: value}, origin="--set")


def build_config(
    *,
    preset: str = "default",
    main_job: bool = False,
    processes: bool = False,
    config_file: str | None = None,
    overrides: tuple[str, ...] = (),
    **flags: Any,
) -> Config:
    """Compose a validated Config. ``flags`` are ``section__key=value`` from explicit CLI options;
    ``main_job`` adds :data:`MAIN_JOB`'s failures and slow learner on top of the preset; ``processes``
    (a run of real processes) trains for :data:`PROCESSES_TIME_S` where nothing else sets a budget."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    config = Config()
    for section, values in PRESETS[preset].items():
        config = apply_section(config, section, values, origin=f"preset {preset}")
    for section, values in (MAIN_JOB[preset] if main_job else {}).items():
        config = apply_section(config, section, values, origin=f"ddiloco run's {preset} preset")
    if config_file:
        config = load_toml(config, config_file)
    for assignment in overrides:
        config = apply_override(config, assignment)
    for name, value in flags.items():
        if value is None:
            continue
        section, key = name.split("__")
        config = apply_section(config, section, {key: value}, origin=f"--{key.replace('_', '-')}")
    if flags.get("run__time_s") and not flags.get("run__tokens"):
        config = replace(config, run=replace(config.run, tokens=0))  # a time budget replaces the preset's tokens
    preset_budget = (PRESETS[preset]["run"].get("tokens", Config().run.tokens), Config().run.time_s)
    if processes and preset in PROCESSES_TIME_S and (config.run.tokens, config.run.time_s) == preset_budget:
        config = replace(config, run=replace(config.run, tokens=0, time_s=PROCESSES_TIME_S[preset]))
    return config.validate()
