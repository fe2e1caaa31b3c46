"""``ddiloco status HOST:PORT``: what a running synchronizer knows."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from ddiloco.commands.display import print_table
from ddiloco.commands.options import positive_seconds
from ddiloco.core.shared.errors import DdilocoError
from ddiloco.core.sync_side.refusals import lost_total
from ddiloco.runtime.auth import load_token, parse_address
from ddiloco.runtime.call_errors import Unreachable
from ddiloco.runtime.http_probe import wrong_port_line
from ddiloco.runtime.status.call import status_dict
from ddiloco.runtime.status.wire_form import LEARNERS_PAGE

HELP = "learners, fragment versions, rejections and bytes of a running synchronizer"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "status",
        help=HELP,
        description="Ask a running synchronizer (`ddiloco sync`) for its state.",
    )
    parser.add_argument("address", metavar="HOST:PORT[,HOST:PORT...]",
                        help="the synchronizer; a sharded one: every shard, comma-separated")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--token-file", metavar="FILE", help="shared auth token (else $DDILOCO_TOKEN)")
    parser.add_argument("--tls-ca", metavar="FILE", help="trust this certificate authority (TLS)")
    parser.add_argument("--timeout", type=positive_seconds, default=5.0, metavar="SECONDS",
                        help="give up when the synchronizer has not answered within this many seconds (default 5)")
    parser.add_argument("--page", type=int, default=0, metavar="K",
                        help="which page of learners to show (%d a page, in id order; default 0)" % LEARNERS_PAGE)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.page < 0:
        raise DdilocoError(f"--page {args.page}: must be >= 0")
    addresses = [parse_address(a.strip(), option="address") for a in args.address.split(",") if a.strip()]
    token = load_token(args.token_file)
    try:
        shards = [status_dict(str(a), token=token, tls_ca=args.tls_ca, timeout_s=args.timeout,
                              learner_offset=args.page * LEARNERS_PAGE, learner_limit=LEARNERS_PAGE)
                  for a in addresses]
    except Unreachable as err:
        for address in addresses:  # an HTTP port of the synchronizer's, given by mistake?
            if line := wrong_port_line(address, "ddiloco status"):
                raise DdilocoError(line) from None
        raise DdilocoError(f"cannot reach the synchronizer at {args.address}: {err}") from None
    if len(shards) == 1:
        status = shards[0]
    else:
        from ddiloco.runtime.sharded import merge_statuses  # by the core's merge rules: torch, for a sharded run only

        status = merge_statuses(shards)
    if args.json:
        json.dump(status, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print_status(status)
    return 0


def print_status(s: dict) -> None:
    out = Console()
    state = s["phase"]
    shards = f" ({s['shards']} shards)" if s.get('shards', 1) > 1 else ""
    out.print(f"[bold]synchronizer[/bold]{shards} {s['instance_id'][:25]}  {s['mode']}  {state}  up {s['uptime']:.0f}s  "
              f"{budgets(s)}  goodput {s['goodput']:.1%}  honest steps refused {s.get('honest_refused_steps', 0):,}  "
              f"MB up {s['bytes_up'] / 1e6:.2f}  MB down {s['bytes_down'] / 1e6:.2f}  "
              f"checkpoints {s['checkpoints']}")
    q, g = s["quorum"], s["grace"]
    rounds = ", ".join(f"{k} {v}" for k, v in q["rounds_closed"].items()) or "none"
    out.print(f"quorum K={q['required']} (effective {q['effective']})  rounds: {rounds}  "
              f"grace window {g['window_s'] * 1e3:.0f} ms (quorum {g['quorum_s'] * 1e3:.0f} ms, "
              f"sync {g['sync_s'] * 1e3:.0f} ms)  longest pause between merges {s['longest_pause_s']:.2f}s")
    if s["rejections"]:
        out.print("rejections: " + ", ".join(f"{k} {v}" for k, v in s["rejections"].items()))
    if s.get("idle_registrations"):
        out.print(f"[yellow]idle registrations: {s['idle_registrations']}[/yellow] hold a lease without having been "
                  f"heard from since their join (the oldest for {s['oldest_idle_registration_s']:.0f}s): abandoned "
                  "joins, or a flood of them; a learner of the run that restarts takes the place of one")
    if s.get("checkpoint_failures"):
        out.print(f"[red]failed checkpoint writes: {s['checkpoint_failures']}[/red] (last: {s['last_checkpoint_error']})")
    learners = Table(title=f"learners ({len(s['learners'])} of {s.get('learners_total', len(s['learners']))}; "
                           f"{s.get('learners_forgotten', 0)} forgotten)")
    for col in ("id", "alive", "last seen", "accepted", "per min", "rejected", "steps refused", "joins", "tokens",
                "data at", "step ms", "MB up", "MB down"):
        learners.add_column(col, justify="left" if col == "id" else "right", no_wrap=col == "id")  # ids whole
    for lr in s["learners"]:
        seen = f"{lr['last_seen_s_ago']:.1f}s ago" if lr["last_seen_s_ago"] >= 0 else "-"
        state = "no" if not lr["alive"] else "joining" if lr["joining"] else "starved" if lr["link_starved"] else "yes"
        learners.add_row(lr["id"], state, seen, str(lr["accepted"]), str(lr["accepted_per_min"]), str(lr["rejected"]),
                         _lost(lr.get("refused_steps", {})), str(lr["registrations"]),
                         f"{lr['tokens']:,}", f"{lr['data_position']:,}",
                         f"{lr['step_time_s'] * 1e3:.0f}",
                         f"{lr['bytes_up'] / 1e6:.2f}", f"{lr['bytes_down'] / 1e6:.2f}")
    print_table(learners)
    fragments = Table(title="fragments")
    for col in ("id", "version", "parameters", "MB up", "MB down"):
        fragments.add_column(col, justify="right")
    for f in s["fragments"]:
        fragments.add_row(str(f["id"]), str(f["version"]), f"{f['numel']:,}", f"{f['bytes_up'] / 1e6:.2f}",
                          f"{f['bytes_down'] / 1e6:.2f}")
    print_table(fragments)


def _lost(refused_steps: dict[str, int]) -> str:
    """The steps of a learner's work the synchronizer threw away, in red when there are any: in a
    real run every learner is honest by assumption, so each one is a defect its user must see."""
    steps = lost_total(refused_steps)
    return f"[red]{steps:,}[/red]" if steps else "0"


def budgets(s: dict) -> str:
    """Tokens and run time, each with its budget and what is left of it, when there is one."""
    tokens = f"tokens {s['tokens']:,}"
    if s["token_budget"]:
        tokens += f" of {s['token_budget']:,} ({s['tokens_left']:,} left)"
    time = f"run time {s['elapsed_s']:.0f}s"
    if s["time_budget_s"]:
        time += f" of {s['time_budget_s']:.0f}s ({s['time_left_s']:.0f}s left)"
    return f"{tokens}  {time}"
