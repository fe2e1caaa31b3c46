"""``ddiloco bandwidth``: wide-area bandwidth of data parallel vs Decoupled DiLoCo.

The model is :mod:`ddiloco.scale.bandwidth_model`; docs/bandwidth.md says where every input comes from.
Options override the chosen preset, so ``--preset paper-8dc --sites 4`` asks "and with four?".
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from ddiloco.scale import bandwidth_model as bw

HELP = "wide-area bandwidth needed by data parallel vs Decoupled DiLoCo"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bandwidth",
        help=HELP,
        description="Compute the per-site wide-area bandwidth that data parallel (bf16 gradients "
        "all-reduced every step, hidden behind the backward pass) and Decoupled DiLoCo (one int4 "
        "fragment per step, tau steps to deliver it) need to reach a target compute utilization, "
        "and their step times on a given link. See docs/bandwidth.md.",
    )
    parser.add_argument("--preset", default="paper-8dc",
                        help=f"starting inputs: {', '.join(bw.PRESETS)} (default paper-8dc)")
    x = parser.add_argument_group("inputs (override the preset)")
    x.add_argument("--params", metavar="N", help="model parameters, e.g. 12B, 350M, 1.5e10")
    x.add_argument("--step-s", type=float, metavar="S", help="compute time of one inner step")
    x.add_argument("--sites", type=int, metavar="K", help="datacenters / regions")
    x.add_argument("--dp-bits", type=float, metavar="B", help="bits per data-parallel gradient value (bf16: 16)")
    x.add_argument("--bits", type=float, metavar="B", help="bits per Decoupled DiLoCo value on the wire (int4: 4)")
    x.add_argument("--block-size", type=int, metavar="N", help="quantization block, adds a 32-bit scale (0: none)")
    x.add_argument("--inner-steps", type=int, metavar="H", help="inner steps between syncs of one fragment")
    x.add_argument("--fragments", type=int, metavar="P", help="fragments (default H: one per step)")
    x.add_argument("--overlap-steps", type=int, metavar="TAU", help="steps a fragment has for its round trip")
    x.add_argument("--target-utilization", type=float, metavar="U", help="compute utilization to reach, in (0, 1]")
    x.add_argument("--backward-share", type=float, metavar="F", help="share of a step the all-reduce can hide in")
    x.add_argument("--latency-ms", type=float, metavar="MS", help="one-way latency between sites")
    parser.add_argument("--link-gbps", type=float, nargs="+", metavar="GBPS",
                        help="also report step times and speed-up on these links (preset's by default)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    base = bw.preset(args.preset)
    inputs = bw.with_overrides(
        base,
        params=bw.parse_params(args.params) if args.params is not None else None,
        step_s=args.step_s,
        sites=args.sites,
        dp_bits=args.dp_bits,
        bits=args.bits,
        block_size=args.block_size,
        inner_steps=args.inner_steps,
        fragments=args.fragments,
        overlap_steps=args.overlap_steps,
        target_utilization=args.target_utilization,
        backward_share=args.backward_share,
        latency_s=args.latency_ms / 1000 if args.latency_ms is not None else None,
    )
    links = tuple(args.link_gbps) if args.link_gbps else bw.PRESET_LINKS_GBPS[args.preset]
    result = bw.evaluate(inputs, links)
    if args.json:
        print(json.dumps({"preset": args.preset, **result.to_json(), "published": bw.PUBLISHED[args.preset]}, indent=1))
        return 0
    _print(result, args.preset, inputs == base)
    return 0


def _print(result: bw.BandwidthResult, preset: str, unchanged: bool) -> None:
    x = result.inputs
    console = Console()
    console.print(
        f"{x.params / 1e9:g}B parameters, {x.sites} sites, step {x.step_s:g} s, H = {x.inner_steps}, "
        f"P = {x.fragment_count}, tau = {x.overlap_steps}, {x.dp_bits:g}-bit dp vs {x.wire_bits:g}-bit "
        f"decoupled, target utilization {x.target_utilization:.0%}"
    )
    published = bw.PUBLISHED.get(preset, {}) if unchanged else {}
    table = Table(title=f"wide-area bandwidth per site and direction ({preset}{'' if unchanged else ', modified'})")
    table.add_column("method")
    table.add_column("required Gbit/s", justify="right")
    if "dp_gbps" in published:
        table.add_column("published Gbit/s", justify="right")
    for method, required, key in (("data parallel", result.dp_gbps, "dp_gbps"),
                                  ("Decoupled DiLoCo", result.decoupled_gbps, "decoupled_gbps")):
        table.add_row(method, f"{required:.4g}", *([f"{published[key]:g}"] if key in published else []))
    console.print(table)
    console.print(f"reduction: {result.reduction:.0f}x; one learner sends (and receives) "
                  f"{result.learner_bytes_per_step / 1e6:.4g} MB per inner step")
    if result.links:
        links = Table(title="on a given link")
        for col in ("link Gbit/s", "dp step s", "decoupled step s", "dp util", "decoupled util", "speed-up"):
            links.add_column(col, justify="right")
        for r in result.links:
            links.add_row(f"{r.link_gbps:g}", f"{r.dp_step_s:.3g}", f"{r.decoupled_step_s:.3g}",
                          f"{r.dp_utilization:.1%}", f"{r.decoupled_utilization:.1%}", f"{r.speedup:.1f}x")
        console.print(links)
    if "min_speedup" in published:
        links_text = " and ".join(f"{g:g}" for g in published["link_gbps"])
        console.print(f"published: on {links_text} Gbit/s links, Decoupled DiLoCo trains more than "
                      f"{published['min_speedup']:g}x faster than data parallel")
