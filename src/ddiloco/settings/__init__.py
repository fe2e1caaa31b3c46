"""A run's configuration: the dataclasses, where they come from (presets, TOML, --set), their docs."""
