"""``ddiloco eval``: the eval loss of an exported model of the reference workload.

A run ends with ``model.safetensors`` (``ddiloco export`` writes it again); loading it needs the
model it is a ``state_dict`` of, and for the reference workload that model was built from the run's
configuration by code a user had to read the source to find (issue 57). This command builds it from
the run's ``config.toml`` (beside the model file, where ``ddiloco run`` writes both) or from
``--config`` / ``--preset``, loads the file strictly and prints the eval loss on the held-out bytes
the run evaluated on: the figure the run reported. A model of your own (``--init``) is yours to
evaluate. Torch is imported only once the arguments are checked.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddiloco.core.shared.errors import ConfigError

HELP = "the eval loss of an exported model of the reference workload (model.safetensors of a run)"
CONFIG_FILE = "config.toml"
"""The run's resolved configuration, beside its model file (``outputs/reporting.py``)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "eval",
        help=HELP,
        description="Build the reference workload's model from a run's configuration, load MODEL into it "
        "(strictly) and print its eval loss, the figure the run reported. The configuration: --config, else "
        f"the {CONFIG_FILE} beside MODEL (ddiloco run writes both), else --preset.",
    )
    parser.add_argument("model", metavar="MODEL.safetensors", help="a run's model file (ddiloco run, export, launch)")
    parser.add_argument("--config", metavar="FILE", help=f"the run's configuration (default: {CONFIG_FILE} beside MODEL)")
    parser.add_argument("--preset", help="the run's preset, where no configuration file is at hand (launch, sync)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable), as the run was given it")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model_file = Path(args.model)
    if not model_file.is_file():
        raise ConfigError(f"{args.model!r}: no such file (a run's model.safetensors, or what ddiloco export wrote)")
    config_file = args.config or (str(model_file.parent / CONFIG_FILE)
                                  if (model_file.parent / CONFIG_FILE).is_file() and not args.preset else None)
    if config_file is None and args.preset is None:
        raise ConfigError(f"which run is {str(model_file)!r} of? No {CONFIG_FILE} beside it: pass --config "
                          "RUN/config.toml or the run's --preset (and its --set)")
    from ddiloco.settings.config_sources import build_config

    config = build_config(preset=args.preset or "default", config_file=config_file, overrides=tuple(args.overrides))
    from ddiloco.workload.workload import Workload  # torch: the arguments are checked

    workload = Workload.build(config)
    loss = workload.evaluate(workload.load_model(model_file))
    print(f"eval loss {loss:.4f} nats/byte ({config.train.eval_batches} held-out batches of "
          f"{config.train.batch_size} x {config.model.seq_len} bytes; {model_file})")
    return 0
