"""The command line every example shares: ``init OUT`` writes the initial weights the synchronizer
serves, ``learner`` trains one learner against it.

Each example brings its model options and its two roles; the learner's options for the data, the
optimizer and the link are the same everywhere. Bad input, unusable text and a synchronizer's
refusal are one line (``PROG: error: ...``) and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from byte_text import TextError

from ddiloco.core.shared.errors import DdilocoError

Role = Callable[[argparse.Namespace], None]
Options = Callable[[argparse.ArgumentParser], None]


def roles_parser(prog: str, description: str, model_options: Options, init: Role, learner: Role, *,
                 lr: float, data_options: Options | None = None) -> argparse.ArgumentParser:
    """``prog init OUT`` and ``prog learner``; ``model_options`` go to both (they must agree),
    ``data_options`` to the learner only; ``lr``: the inner optimizer's default learning rate."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    p_init = roles.add_parser("init", help="write the initial weights for `ddiloco sync --init`")
    p_init.add_argument("out", type=Path, metavar="OUT.safetensors")
    model_options(p_init)
    p_init.set_defaults(func=init)
    p_learn = roles.add_parser("learner", help="train one learner against `ddiloco sync`")
    p_learn.add_argument("--connect", metavar="HOST:PORT",
                         help="the synchronizer's address (under `ddiloco launch`: given through the environment)")
    p_learn.add_argument("--id", help="this learner's id, stable across restarts (under `ddiloco launch`: given)")
    model_options(p_learn)
    p_learn.add_argument("--text", type=Path, help="training text: a file or a directory (default: Python's stdlib)")
    if data_options is not None:
        data_options(p_learn)
    p_learn.add_argument("--batch-size", type=int, default=16, help="sequences per inner step (default 16)")
    p_learn.add_argument("--lr", type=float, default=lr, help=f"inner AdamW learning rate (default {lr:g})")
    p_learn.add_argument("--max-steps", type=int, help="leave after N steps even if the budget is not spent")
    p_learn.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p_learn.add_argument("--token-file", type=Path, help="shared auth token (else $DDILOCO_TOKEN)")
    p_learn.add_argument("--join-timeout", type=float, help="give up if the synchronizer stays unreachable (s)")
    p_learn.add_argument("--log-every", type=int, default=20, help="print the mean loss every N steps")
    p_learn.set_defaults(func=learner)
    return parser


def run_role(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` and play its role; the exit status."""
    args = parser.parse_args(argv)
    try:
        if args.role == "learner" and (args.lr <= 0 or args.log_every < 1
                                       or (args.max_steps is not None and args.max_steps < 0)):
            raise DdilocoError(f"need --lr > 0, --log-every >= 1, --max-steps >= 0; got {args.lr}, "
                               f"{args.log_every}, {args.max_steps}")
        args.func(args)
    except (DdilocoError, TextError, OSError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
