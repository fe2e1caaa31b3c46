"""``ddiloco export``: the global model of a run as a file the model loads.

From a state directory (the latest checkpoint with the round log replayed: every round merged
before the synchronizer stopped or died) or from a running synchronizer (``--from``: read as an
evaluator reads it, no learner registered). The logic is :mod:`ddiloco.runtime.sync.model_export`; torch is
imported only once the arguments are checked.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ddiloco.core.shared.errors import ConfigError

HELP = "write a run's global model as a state_dict file (safetensors) or a Hugging Face folder"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "export",
        help=HELP,
        description="Write the global model of a run as the model's own state_dict (parameter names and "
        "shapes), loadable with model.load_state_dict(safetensors.torch.load_file(OUT)). From a state "
        "directory: its latest checkpoint plus the round log (nothing merged is missing); from a running "
        "synchronizer with --from.",
    )
    parser.add_argument("state_dir", nargs="?", metavar="STATE_DIR[,STATE_DIR...]",
                        help="the synchronizer's --state-dir (a sharded one: every shard's, comma-separated)")
    parser.add_argument("out", nargs="?", metavar="OUT.safetensors", help="the file to write")
    parser.add_argument("--from", dest="address", metavar="HOST:PORT[,HOST:PORT...]",
                        help="export from this running synchronizer instead of a state directory")
    parser.add_argument("--init", metavar="FILE",
                        help="the run served your own model: the --init file given to `ddiloco sync`")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="tensor type (default fp32)")
    parser.add_argument("--hf", metavar="DIR",
                        help="also write a Hugging Face folder (config.json, model.safetensors) that "
                        "from_pretrained loads: for a run started from one (examples/hf_causal_lm.py)")
    parser.add_argument("--force", action="store_true", help="replace OUT (and --hf DIR) if they exist")
    parser.add_argument("--token-file", metavar="FILE", help="with --from: shared auth token (else $DDILOCO_TOKEN)")
    parser.add_argument("--tls-ca", metavar="FILE", help="with --from: trust this certificate authority (TLS)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sources, out = _positional(args)
    init = Path(args.init) if args.init else None
    if init is not None and not init.is_file():
        raise ConfigError(f"--init {args.init!r}: no such file")
    hf = Path(args.hf) if args.hf else None
    if hf is not None and hf.exists() and any(hf.iterdir()) and not args.force:
        raise ConfigError(f"--hf {args.hf!r} exists and is not empty: pass --force to write into it")
    from ddiloco.runtime.sync.resume import holds_no_run, surely_empty

    if empty := next((path for path in sources if surely_empty(path)), None):
        raise ConfigError(holds_no_run(empty))  # said before torch is imported: a second of CPU
    from ddiloco.runtime.sync import model_export
    from ddiloco.workload import model_file

    if out is not None:
        model_export.check_out(out, force=args.force)
    if args.address:
        from ddiloco.runtime.auth import load_token, parse_address

        addresses = [str(parse_address(a, option="--from")) for a in args.address.split(",")]
        model, values = _from_synchronizer(addresses, init, load_token(args.token_file), args.tls_ca)
    else:
        model, values = model_export.from_state_dirs(sources, init)
    tensors = model.state_dict(values)
    if hf is not None:
        model_export.save_hf(hf, tensors, model.hf_config, args.dtype)
        print(f"wrote {hf}/ (Hugging Face: config.json, model.safetensors)")
    if out is not None:
        model_file.save_state_dict(out, tensors, args.dtype)
        count = sum(t.numel() for name, t in tensors.items())
        print(f"wrote {out}: {len(tensors)} tensors, {count:,} values ({args.dtype}); load it with "
              "model.load_state_dict(safetensors.torch.load_file(...))")
    return 0


def _positional(args: argparse.Namespace) -> tuple[list[Path], Path | None]:
    """(state directories, OUT): ``STATE_DIR OUT``, or with ``--from`` just ``OUT``; ``--hf`` may replace OUT."""
    given = [a for a in (args.state_dir, args.out) if a is not None]
    wanted = 0 if args.address else 1
    if len(given) < wanted + (0 if args.hf else 1) or len(given) > wanted + 1:
        raise ConfigError("expected " + ("--from HOST:PORT OUT.safetensors" if args.address else
                                         "STATE_DIR OUT.safetensors") + " (or --hf DIR in place of OUT)")
    sources = [Path(p) for p in given[0].split(",")] if wanted else []
    out = Path(given[wanted]) if len(given) > wanted else None
    return sources, out


def _from_synchronizer(addresses: list[str], init: Path | None, token: str | None,
                       tls_ca: str | None) -> tuple[Any, dict[int, Any]]:
    """Θ from the running synchronizer; an unreachable one or refused credentials in one line."""
    from ddiloco.runtime.client import CallRefused, Unreachable
    from ddiloco.runtime.sync import model_export

    try:
        return model_export.from_synchronizer(addresses, init, token=token, tls_ca=tls_ca)
    except Unreachable as err:
        raise ConfigError(f"--from: no synchronizer answers at {','.join(addresses)} ({err})") from None
    except CallRefused as err:
        raise ConfigError(f"--from: the synchronizer refused: {err.detail}") from None
