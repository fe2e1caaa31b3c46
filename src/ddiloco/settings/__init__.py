"""A run's configuration: the dataclasses, where they come from (presets, TOML, --set), their docs.
It imports nothing but the core, so the workload, the simulator and chaos read it from below.

- :mod:`~ddiloco.settings.config`: the run's configuration, one dataclass per component, checked
  when built;
- :mod:`~ddiloco.settings.workload_settings`: the model's sizes and the inner steps' arithmetic and
  schedule, apart from torch so a bad configuration is refused without importing it;
- :mod:`~ddiloco.settings.config_sources`: the layers a configuration is composed from (presets,
  the main job's extras, TOML, ``--set``, CLI flags), each mistake one line;
- :mod:`~ddiloco.settings.config_docs`: ``docs/config.md`` generated from the fields' docstrings;
- :mod:`~ddiloco.settings.fault_kinds`: every kind of fault named once, with where it can be
  injected, shared by the simulator's adversary and ``ddiloco chaos``;
- :mod:`~ddiloco.settings.did_you_mean`: the closest name to a mistyped ``--set`` key or section;
- :mod:`~ddiloco.settings.units`: counts and sizes in the units a person reads (``1.2M``, ``512 kB``).
"""
