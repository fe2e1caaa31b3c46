"""The command lines of a run's children, built once: ``ddiloco sync`` and ``ddiloco learner``.

Every launcher starts its synchronizer from a :class:`SyncLine` (``ddiloco run --runtime
processes``, ``ddiloco chaos``, ``ddiloco launch``), and so do the tests' and benchmarks'
harness (:mod:`ddiloco.testing.commands`), so a flag of ``ddiloco sync`` is spelled in one place
besides its parser. No torch here: ``ddiloco launch`` imports this before any child does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SyncLine:
    """``ddiloco sync``'s command line (the words after ``ddiloco``); a field left at None (or
    False, or empty) is a flag left out, so the synchronizer's own default holds."""

    listen: str = "127.0.0.1:0"
    """``HOST:PORT``; port 0: any free port, written to ``port_file``."""
    port_file: Path | None = None
    state_dir: Path | None = None
    config: Path | str | None = None
    """A TOML file of the run's configuration."""
    preset: str | None = None
    sets: tuple[str, ...] = ()
    """``SECTION.KEY=VALUE`` overrides, each a ``--set``."""
    learners: int | None = None
    tokens: int | None = None
    time_s: float | None = None
    init: Path | str | None = None
    """Initial weights of the user's own model (``save_initial_state()``)."""
    shard: tuple[int, int] | None = None
    """(index, shards) of a synchronizer sharded by fragment."""
    http_port: int | None = None
    resume: bool = False
    token_file: Path | str | None = None
    exit_when_finished: bool = False
    log_level: str | None = None

    def words(self, *extra: str) -> list[str]:
        """The command line, ``extra`` last (a flag given twice takes its last value)."""
        valued = {"--preset": self.preset, "--config": self.config, "--listen": self.listen,
                  "--learners": self.learners, "--tokens": self.tokens, "--time": self.time_s, "--init": self.init,
                  "--shard": None if self.shard is None else f"{self.shard[0]}/{self.shard[1]}",
                  "--port-file": self.port_file, "--state-dir": self.state_dir, "--http-port": self.http_port,
                  "--token-file": self.token_file, "--log-level": self.log_level}
        flags = {"--resume": self.resume, "--exit-when-finished": self.exit_when_finished}
        return ["sync", *(word for flag, value in valued.items() if value is not None for word in (flag, str(value))),
                *(word for override in self.sets for word in ("--set", override)),
                *(flag for flag, on in flags.items() if on), *extra]


def learner_command(addresses: list[str], learner_id: str, threads: int, device: str,
                    min_step_s: float = 0.0, *, token_file: Path | None = None,
                    progress_file: Path | None = None, batch_log: Path | None = None) -> list[str]:
    """``ddiloco learner`` taking the synchronizer's configuration (same model, shards and data order).

    ``min_step_s`` pads every inner step (``--min-step-s``): slower hardware, or CPU left over
    for restarts when chaos runs many processes on a small machine.
    """
    return ["learner", "--connect", ",".join(addresses), "--id", learner_id, "--threads", str(threads),
            "--device", device, *(["--min-step-s", str(min_step_s)] if min_step_s else []),
            *(["--token-file", str(token_file)] if token_file else []),
            *(["--progress-file", str(progress_file)] if progress_file else []),
            *(["--batch-log", str(batch_log)] if batch_log else [])]
